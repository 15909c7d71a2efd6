//! GPU tests: every op of the CUDA backend against the CPU backend (the reference), on fresh
//! random inputs (the seed is printed), with outputs poisoned with NaN first and sizes the
//! kernels' tiles do not divide; then whole models, greedy, token for token.
//!
//! Run on a GPU machine: `cargo test -p nibble-cuda --features gpu-tests` (scripts/gpu-run.sh
//! runs the prebuilt binary). Error bounds: f32 math well under 1e-3 relative; anything that
//! passes through bf16 (GEMM operands, the KV cache, 16-bit outputs) under 1e-2.

use half::{bf16, f16};
use nibble_cpu::{CpuBackend, CpuTensor};
use nibble_cuda::qlinear::KernelTier;
use nibble_cuda::{CudaBackend, CudaTensor, Dtype};
use nibble_engine::{Engine, SamplingParams};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::{
    AttentionShape, Backend, BatchLayout, KvShape, RopeLayout, SeqSpan, Transformer, open_model,
};
use nibble_precision::KvSpec;

use common::{fixture, greedy, top2};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "gpu/common.rs"]
mod common;
#[path = "gpu/kv.rs"]
mod kv;
#[path = "gpu/qgemm.rs"]
mod qgemm;
#[path = "gpu/sampling.rs"]
mod sampling;

fn rng(test: &str) -> ChaCha8Rng {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("{test}: seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

fn gpu(dtype: Dtype) -> CudaBackend {
    CudaBackend::new(0, dtype).expect("a CUDA GPU")
}

fn cpu() -> CpuBackend {
    CpuBackend::new(4).unwrap()
}

fn randn(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Sum of uniforms: bell-shaped, with the occasional larger value.
            let s: f32 = (0..4).map(|_| r.random::<f32>() - 0.5).sum();
            s * scale * 1.7
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖, failing on any NaN or infinity in `a`.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    if let Some(i) = a.iter().position(|x| !x.is_finite()) {
        panic!(
            "element {i} of {} is {} (unwritten or overflowed)",
            a.len(),
            a[i]
        );
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn check(what: &str, got: &[f32], want: &[f32], bound: f64) {
    let e = rel_err(got, want);
    assert!(e < bound, "{what}: relative error {e:.2e} over {bound:.0e}");
}

/// A `[rows, cols]` weight in `ty` (BF16, F16 or F32) from f32 values.
fn host_weight(name: &str, values: &[f32], rows: usize, cols: usize, ty: GgmlType) -> HostTensor {
    let bytes: Vec<u8> = match ty {
        GgmlType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::F32 => values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        other => panic!("{other:?}"),
    };
    HostTensor {
        name: name.into(),
        shape: vec![rows, cols],
        format: WeightFormat::Ggml(ty),
        bytes: TensorBytes::Owned(std::sync::Arc::new(bytes)),
    }
}

/// The value a 16-bit weight holds (what both backends compute with).
fn rounded(values: &[f32], ty: GgmlType) -> Vec<f32> {
    match ty {
        GgmlType::BF16 => values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        GgmlType::F16 => values.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        _ => values.to_vec(),
    }
}

fn to_gpu(g: &CudaBackend, t: &CpuTensor) -> CudaTensor {
    g.tensor_from_f32(&t.data, t.rows, t.cols).unwrap()
}

fn host(g: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    g.to_host(t).unwrap()
}

/// Sequences with the given (start, len), each given shuffled blocks of a pool of `pool` blocks.
fn layout(r: &mut ChaCha8Rng, spans: &[(usize, usize)], block: usize, pool: usize) -> BatchLayout {
    let mut free: Vec<u32> = (0..pool as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, r.random_range(0..=i));
    }
    let seqs = spans
        .iter()
        .map(|&(start, len)| {
            let need = (start + len).div_ceil(block);
            SeqSpan {
                blocks: free.drain(..need).collect(),
                start_pos: start,
                len,
            }
        })
        .collect();
    BatchLayout { seqs }
}

#[test]
fn row_ops_match_cpu() {
    let mut r = rng("row_ops_match_cpu");
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let (g, c) = (gpu(dtype), cpu());
        // Rows of a width that is a multiple of 4 and at most 16K take the register path
        // (common.cuh); 1001 (odd) and 20000 (past 16K: the paged loop, and several register
        // pages for the gated activations) the other one.
        for &(rows, h) in &[
            (1usize, 576usize),
            (7, 1000),
            (33, 4096),
            (1, 10000),
            (3, 1001),
            (2, 20000),
        ] {
            g.poison_activations(64 << 20).unwrap();
            let x = CpuTensor::new(randn(&mut r, rows * h, 1.0), rows, h);
            let d = CpuTensor::new(randn(&mut r, rows * h, 0.5), rows, h);
            let w = c.load_vector(&randn(&mut r, h, 1.0)).unwrap();
            let gw = g.load_vector(&w.data).unwrap();

            let want = c.rms_norm(&x, &w, 1e-5);
            let got = g.rms_norm(&to_gpu(&g, &x), &gw, 1e-5);
            check("rms_norm", &host(&g, &got), &want.data, 1e-2);

            let want = c.residual_rms_norm(&x, &w, 1e-6);
            let got = g.residual_rms_norm(&to_gpu(&g, &x), &gw, 1e-6);
            check("residual_rms_norm", &host(&g, &got), &want.data, 1e-6);

            let (mut cx, mut gx) = (x.clone(), to_gpu(&g, &x));
            let want = c.add_rms_norm(&mut cx, &d, &w, 1e-6);
            let got = g.add_rms_norm(&mut gx, &to_gpu(&g, &d), &gw, 1e-6);
            check("add_rms_norm output", &host(&g, &got), &want.data, 1e-2);
            check("add_rms_norm residual", &host(&g, &gx), &cx.data, 1e-6);

            let want = c.silu_mul(&x, &d);
            let got = g.silu_mul(&to_gpu(&g, &x), &to_gpu(&g, &d));
            check("silu_mul", &host(&g, &got), &want.data, 1e-2);

            let want = c.gelu_tanh_mul(&x, &d);
            let got = g.gelu_tanh_mul(&to_gpu(&g, &x), &to_gpu(&g, &d));
            check("gelu_tanh_mul", &host(&g, &got), &want.data, 1e-2);

            let (mut cx, mut gx) = (x.clone(), to_gpu(&g, &x));
            c.scale(&mut cx, 25.3);
            g.scale(&mut gx, 25.3);
            check("scale", &host(&g, &gx), &cx.data, 1e-7);

            let (mut cx, mut gx) = (x.clone(), to_gpu(&g, &x));
            c.add(&mut cx, &d);
            g.add(&mut gx, &to_gpu(&g, &d));
            check("add", &host(&g, &gx), &cx.data, 1e-7);

            let pick: Vec<usize> = (0..rows.div_ceil(2))
                .map(|_| r.random_range(0..rows))
                .collect();
            let want = c.gather_rows(&x, &pick);
            let got = g.gather_rows(&to_gpu(&g, &x), &pick);
            check("gather_rows", &host(&g, &got), &want.data, 1e-7);

            for head_dim in [32, 64] {
                let hw = c.load_vector(&randn(&mut r, head_dim, 1.0)).unwrap();
                let (mut cx, mut gx) = (x.clone(), to_gpu(&g, &x));
                c.head_rms_norm(&mut cx, &hw, head_dim, 1e-6);
                g.head_rms_norm(&mut gx, &g.load_vector(&hw.data).unwrap(), head_dim, 1e-6);
                check("head_rms_norm", &host(&g, &gx), &cx.data, 1e-5);
            }

            // RoPE at positions up to 1e5 in both layouts, over a batch of three sequences.
            let split = [rows / 3, rows / 3, rows - 2 * (rows / 3)];
            let spans: Vec<(usize, usize)> = split
                .iter()
                .filter(|&&l| l > 0)
                .map(|&l| (r.random_range(0..100_000), l))
                .collect();
            let batch = layout(&mut r, &spans, 1 << 20, 8);
            // Head size 320: past the kernel's shared table of angles (up to 256).
            for (head_dim, lay) in [
                (64, RopeLayout::HalfSplit),
                (64, RopeLayout::Interleaved),
                (320, RopeLayout::HalfSplit),
            ] {
                let half = head_dim / 2;
                let inv: Vec<f32> = (0..half)
                    .map(|i| 500000f32.powf(-(i as f32) / half as f32))
                    .collect();
                let (ci, gi) = (c.load_vector(&inv).unwrap(), g.load_vector(&inv).unwrap());
                let (mut cx, mut gx) = (x.clone(), to_gpu(&g, &x));
                c.rope(&mut cx, head_dim, &batch, &ci, lay);
                g.rope(&mut gx, head_dim, &batch, &gi, lay);
                check("rope", &host(&g, &gx), &cx.data, 1e-5);
                // q and k in one launch.
                let (mut cq, mut ck) = (x.clone(), d.clone());
                c.rope_qk(&mut cq, &mut ck, head_dim, &batch, &ci, lay);
                let (mut gq, mut gk) = (to_gpu(&g, &x), to_gpu(&g, &d));
                g.rope_qk(&mut gq, &mut gk, head_dim, &batch, &gi, lay);
                check("rope_qk q", &host(&g, &gq), &cq.data, 1e-5);
                check("rope_qk k", &host(&g, &gk), &ck.data, 1e-5);
            }

            let vocab = 301;
            let table = randn(&mut r, vocab * h, 1.0);
            let ht = host_weight("embed", &table, vocab, h, GgmlType::BF16);
            let ids: Vec<u32> = (0..rows).map(|_| r.random_range(0..vocab as u32)).collect();
            let want = c.embed(&c.load_weight(&ht).unwrap(), &ids).unwrap();
            let got = g.embed(&g.load_weight(&ht).unwrap(), &ids).unwrap();
            // bf16 to f16 loses bits on the f16 backend.
            let bound = if dtype == Dtype::Bf16 { 1e-7 } else { 1e-3 };
            check("embed", &host(&g, &got), &want.data, bound);
            let bad = g.embed(&g.load_weight(&ht).unwrap(), &[vocab as u32]);
            assert!(bad.is_err(), "an out-of-range token id must be an error");
        }
    }
}

/// The weighted sum of a mixture-of-experts layer (`scatter_add_scaled`) is the CPU's bit for
/// bit: parts of different lengths, rows that several parts hit, rows no part hits (zero, not
/// the poison), odd widths; malformed parts are errors. Gathering an expert's 16-bit input rows
/// copies them.
#[test]
fn moe_combine_matches_cpu_exactly() {
    let mut r = rng("moe_combine_matches_cpu_exactly");
    let (g, c) = (gpu(Dtype::Bf16), cpu());
    for &(rows, cols, nparts) in &[
        (1usize, 64usize, 2usize),
        (9, 37, 5),
        (64, 4096, 9),
        (3, 1, 1),
    ] {
        g.poison_activations(64 << 20).unwrap();
        let mut xs = Vec::new();
        let mut targets = Vec::new();
        let mut weights = Vec::new();
        for _ in 0..nparts {
            let mut t: Vec<usize> = (0..rows).filter(|_| r.random_bool(0.6)).collect();
            if rows > 1 {
                // Row `rows - 1` is left to no part.
                t.retain(|&i| i != rows - 1);
            }
            xs.push(CpuTensor::new(
                randn(&mut r, t.len() * cols, 1.0),
                t.len(),
                cols,
            ));
            weights.push(randn(&mut r, t.len(), 0.5));
            targets.push(t);
        }
        let gxs: Vec<CudaTensor> = xs.iter().map(|x| to_gpu(&g, x)).collect();
        let want = c
            .scatter_add_scaled(rows, cols, &scaled_rows(&xs, &targets, &weights))
            .unwrap();
        let got = g
            .scatter_add_scaled(rows, cols, &scaled_rows(&gxs, &targets, &weights))
            .unwrap();
        let got = host(&g, &got);
        let same = got
            .iter()
            .zip(&want.data)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "moe combine {rows}x{cols} with {nparts} parts differs from the CPU"
        );
        if rows > 1 {
            assert!(got[(rows - 1) * cols..].iter().all(|&v| v == 0.0));
        }
    }
    // An expert's input: rows of the normed (model dtype) activations.
    let (rows, cols) = (11, 520);
    let x = to_gpu(
        &g,
        &CpuTensor::new(randn(&mut r, rows * cols, 1.0), rows, cols),
    );
    let w = g.load_vector(&randn(&mut r, cols, 1.0)).unwrap();
    let normed = g.rms_norm(&x, &w, 1e-5);
    let all = host(&g, &normed);
    let pick = [10usize, 0, 3, 3];
    let got = host(&g, &g.gather_rows(&normed, &pick));
    let want: Vec<f32> = pick
        .iter()
        .flat_map(|&i| all[i * cols..(i + 1) * cols].iter().copied())
        .collect();
    assert_eq!(got, want, "16-bit row gather");
    let x = to_gpu(&g, &CpuTensor::new(vec![1.0; 8], 2, 4));
    let bad_row = [nibble_model::ScaledRows {
        x: &x,
        rows: &[0, 5],
        scales: &[1.0, 1.0],
    }];
    assert!(g.scatter_add_scaled(2, 4, &bad_row).is_err());
    let bad_len = [nibble_model::ScaledRows {
        x: &x,
        rows: &[0],
        scales: &[1.0],
    }];
    assert!(g.scatter_add_scaled(2, 4, &bad_len).is_err());
}

fn scaled_rows<'a, T>(
    xs: &'a [T],
    rows: &'a [Vec<usize>],
    scales: &'a [Vec<f32>],
) -> Vec<nibble_model::ScaledRows<'a, T>> {
    xs.iter()
        .zip(rows)
        .zip(scales)
        .map(|((x, r), s)| nibble_model::ScaledRows {
            x,
            rows: r,
            scales: s,
        })
        .collect()
}

#[test]
fn linear_matches_cpu() {
    let mut r = rng("linear_matches_cpu");
    for (dtype, ty) in [
        (Dtype::Bf16, GgmlType::BF16),
        (Dtype::F16, GgmlType::F16),
        (Dtype::Bf16, GgmlType::F32),
    ] {
        let (g, c) = (gpu(dtype), cpu());
        for &(m, n, k) in &[
            (1, 576, 576),
            (3, 1536, 576),
            (33, 100, 70),
            (257, 4096, 1024),
        ] {
            g.poison_activations(64 << 20).unwrap();
            let w = randn(&mut r, n * k, 1.0 / (k as f32).sqrt());
            let hw = host_weight("w", &w, n, k, ty);
            // Inputs the 16-bit GEMM sees exactly, so the bound measures accumulation only.
            let x = CpuTensor::new(rounded(&randn(&mut r, m * k, 1.0), ty), m, k);
            let bias = randn(&mut r, n, 0.1);
            let want = c
                .linear(
                    &x,
                    &c.load_weight(&hw).unwrap(),
                    Some(&c.load_vector(&bias).unwrap()),
                )
                .unwrap();
            let got = g
                .linear(
                    &to_gpu(&g, &x),
                    &g.load_weight(&hw).unwrap(),
                    Some(&g.load_vector(&bias).unwrap()),
                )
                .unwrap();
            // f32 weights are rounded to bf16 on the GPU.
            let bound = if ty == GgmlType::F32 { 1e-2 } else { 1e-3 };
            check(
                &format!("linear {m}x{n}x{k} {ty:?}"),
                &host(&g, &got),
                &want.data,
                bound,
            );
        }
        let hw = host_weight("w", &randn(&mut r, 12, 1.0), 3, 4, ty);
        let x = g.tensor_from_f32(&[0.0; 5], 1, 5).unwrap();
        assert!(g.linear(&x, &g.load_weight(&hw).unwrap(), None).is_err());
    }
}

/// A Hopper GPU (the dense decode gemv's), or none, saying so; elsewhere the gemv is not taken.
fn hopper_gpu(dtype: Dtype) -> Option<CudaBackend> {
    let g = gpu(dtype);
    if g.gpu.cc != (9, 0) {
        assert!(!nibble_cuda::dense_gemv::applies(&g, 1, 4096, 4096));
        eprintln!("the dense decode gemv is Hopper's (sm_90a); this GPU is not one");
        return None;
    }
    Some(g)
}

/// The dense decode gemv (1 to 4 tokens, Hopper) against an f64 sum of the 16-bit values and
/// against cuBLAS: row counts that leave CTAs unequal ranges and row groups cut short, every
/// K (multiples of 256 only), both stage sizes, NaN-poisoned outputs. Its sums are
/// deterministic, and a token's output does not depend on the call's other tokens.
#[test]
fn dense_decode_gemv_matches_the_reference() {
    let mut r = rng("dense_decode_gemv_matches_the_reference");
    for (dtype, ty) in [(Dtype::Bf16, GgmlType::BF16), (Dtype::F16, GgmlType::F16)] {
        let Some(mut g) = hopper_gpu(dtype) else {
            return;
        };
        for &(n, k) in &[
            (1, 256),
            (7, 768),
            (131, 1536),
            (1000, 4096),
            (3077, 4096),
            (517, 14336),
            (4096, 2048),
        ] {
            let w = rounded(&randn(&mut r, n * k, 1.0 / (k as f32).sqrt()), ty);
            let gw = g.load_weight(&host_weight("w", &w, n, k, ty)).unwrap();
            let x = rounded(&randn(&mut r, 4 * k, 1.0), ty);
            let mut first_row = Vec::new();
            for m in 1..=4 {
                assert!(nibble_cuda::dense_gemv::applies(&g, m, n, k));
                g.poison_activations(64 << 20).unwrap();
                let gx = g.tensor_from_f32(&x[..m * k], m, k).unwrap();
                let want: Vec<f32> = (0..m * n)
                    .map(|i| {
                        let (t, row) = (i / n, i % n);
                        (0..k)
                            .map(|c| x[t * k + c] as f64 * w[row * k + c] as f64)
                            .sum::<f64>() as f32
                    })
                    .collect();
                let gh = g.as_half(&gx).unwrap();
                let run = |stage_kb| {
                    let out = g.tensor_from_f32(&vec![f32::NAN; m * n], m, n).unwrap();
                    nibble_cuda::dense_gemv::run_staged(&g, &gh, &gw, &out, stage_kb).unwrap();
                    host(&g, &out)
                };
                let got = run(32);
                let what = format!("dense gemv {m}x{n}x{k} {ty:?}");
                check(&what, &got, &want, 1e-5);
                let again = run(32);
                assert!(
                    got.iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: two runs differ"
                );
                // 16 KB stages give each warp other segments: another order of the same sums.
                check(&format!("{what}, 16 KB stages"), &run(16), &want, 1e-5);
                if m == 1 {
                    first_row = got.clone();
                }
                assert!(
                    got[..n]
                        .iter()
                        .zip(&first_row)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: token 0 differs from its one-token product"
                );
                g.dense_gemv = false;
                let cublas = host(&g, &g.linear(&gx, &gw, None).unwrap());
                g.dense_gemv = true;
                check(&format!("{what} against cuBLAS"), &got, &cublas, 1e-5);
            }
        }
        assert!(!nibble_cuda::dense_gemv::applies(&g, 5, 64, 256));
        assert!(!nibble_cuda::dense_gemv::applies(&g, 1, 64, 576));
    }
}

/// A fused normed gemv's (output, residual) against the unfused path's: outputs within `bound`,
/// the residual the same bits.
fn check_normed(what: &str, got: &[(Vec<f32>, Vec<f32>)], bound: f64) {
    check(what, &got[0].0, &got[1].0, bound);
    assert!(
        got[0]
            .1
            .iter()
            .zip(&got[1].1)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: residuals differ"
    );
}

/// The inputs of a one-row `norm_linear`: the residual row, the delta added to it, the norm's
/// weight, the bias.
struct NormedRow<'a> {
    res: &'a [f32],
    delta: Option<&'a [f32]>,
    nw: &'a [f32],
    bias: Option<&'a [f32]>,
}

/// `norm_linear` of `row` with the fused path on (`fuse(g, true)`), then off, each on
/// NaN-poisoned activations: both (output, residual) pairs, fused first; the fused path left on.
/// The fused path leaves the updated residual in a row of its own.
fn normed_both_ways(
    g: &mut CudaBackend,
    w: &nibble_cuda::CudaWeight,
    row: &NormedRow,
    fuse: fn(&mut CudaBackend, bool),
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let k = row.res.len();
    let mut got = Vec::new();
    for fused in [true, false] {
        fuse(g, fused);
        g.poison_activations(64 << 20).unwrap();
        let mut x = g.tensor_from_f32(row.res, 1, k).unwrap();
        let d = row.delta.map(|d| g.tensor_from_f32(d, 1, k).unwrap());
        let gn = g.load_vector(row.nw).unwrap();
        let gb = row.bias.map(|b| g.load_vector(b).unwrap());
        let before = x.ptr;
        let y = g
            .norm_linear(&mut x, d.as_ref(), &gn, 1e-5, w, gb.as_ref())
            .unwrap();
        assert_eq!(x.ptr != before, fused && row.delta.is_some());
        got.push((host(g, &y), host(g, &x)));
    }
    fuse(g, true);
    got
}

/// `norm_linear` of one row on a layer the dense gemv takes: the gemv that norms its row itself
/// against the norm kernel and then the gemv (cuBLAS), with and without a residual delta, a bias,
/// NaN-poisoned activations. The residual it leaves is the same bits; the outputs agree to the
/// f32 order of the norm's sum of squares.
#[test]
fn normed_decode_gemv_matches_the_norm_then_the_gemv() {
    let mut r = rng("normed_decode_gemv_matches_the_norm_then_the_gemv");
    for (dtype, ty) in [(Dtype::Bf16, GgmlType::BF16), (Dtype::F16, GgmlType::F16)] {
        let Some(mut g) = hopper_gpu(dtype) else {
            return;
        };
        for &(n, k) in &[(2600, 4096), (1283, 8192)] {
            assert!(nibble_cuda::dense_gemv::engine_picks(&g, 1, n, k));
            let w = randn(&mut r, n * k, 1.0 / (k as f32).sqrt());
            let gw = g.load_weight(&host_weight("w", &w, n, k, ty)).unwrap();
            let res = randn(&mut r, k, 1.0);
            let delta = randn(&mut r, k, 0.5);
            let nw: Vec<f32> = (0..k).map(|_| 0.5 + r.random::<f32>()).collect();
            let bias = randn(&mut r, n, 0.1);
            for with_delta in [false, true] {
                let row = NormedRow {
                    res: &res,
                    delta: with_delta.then_some(&delta[..]),
                    nw: &nw,
                    bias: Some(&bias),
                };
                let got = normed_both_ways(&mut g, &gw, &row, |g, on| g.dense_gemv = on);
                let what = format!("normed gemv {n}x{k} {ty:?} delta {with_delta}");
                check_normed(&what, &got, 2e-3);
            }
        }
    }
}

/// A SwiGLU layer's 16-bit gate and up loaded as one weight (`load_swiglu_weight`, Hopper): at
/// one token the normed gemv writes `silu(gate) * up` in its epilogue; against the norm kernel,
/// cuBLAS on the stacked pair and the SiLU-gate kernel (the dense gemv off), and against the
/// same weight's two-token product (the stacked product, then the SiLU-gate); with and without a
/// delta, widths that leave CTAs unequal, NaN-poisoned activations. The residual is the same bits.
#[test]
fn swiglu_decode_gemv_matches_the_gemv_then_the_gate() {
    let mut r = rng("swiglu_decode_gemv_matches_the_gemv_then_the_gate");
    for (dtype, ty) in [(Dtype::Bf16, GgmlType::BF16), (Dtype::F16, GgmlType::F16)] {
        let Some(mut g) = hopper_gpu(dtype) else {
            return;
        };
        for &(ff, k) in &[(14336, 4096), (7168, 4096), (1321, 8192)] {
            let gate = randn(&mut r, ff * k, 1.0 / (k as f32).sqrt());
            let up = randn(&mut r, ff * k, 1.0 / (k as f32).sqrt());
            let hg = host_weight("gate", &gate, ff, k, ty);
            let hu = host_weight("up", &up, ff, k, ty);
            let w = g
                .load_swiglu_weight(&hg, &hu)
                .unwrap()
                .expect("a dense SwiGLU weight");
            assert!(matches!(w.data, nibble_cuda::WeightData::DenseSwiGlu(_)));
            assert_eq!((w.rows, w.cols), (ff, k));
            let res = randn(&mut r, 2 * k, 1.0);
            let delta = randn(&mut r, k, 0.5);
            let nw: Vec<f32> = (0..k).map(|_| 0.5 + r.random::<f32>()).collect();
            for with_delta in [false, true] {
                let mut got = Vec::new();
                for fused in [true, false] {
                    g.dense_gemv = fused;
                    g.poison_activations(64 << 20).unwrap();
                    let mut x = g.tensor_from_f32(&res[..k], 1, k).unwrap();
                    let d = g.tensor_from_f32(&delta, 1, k).unwrap();
                    let gn = g.load_vector(&nw).unwrap();
                    let y = g
                        .norm_linear(&mut x, with_delta.then_some(&d), &gn, 1e-5, &w, None)
                        .unwrap();
                    assert_eq!((y.rows, y.cols), (1, ff));
                    got.push((host(&g, &y), host(&g, &x)));
                }
                g.dense_gemv = true;
                let what = format!("SwiGLU gemv {ff}x{k} {ty:?} delta {with_delta}");
                check_normed(&what, &got, 4e-3);
            }
            // Two tokens: the stacked product, then the SiLU-gate, against an f64 reference
            // (the activations rounded to the model dtype, as the GEMM reads them).
            g.poison_activations(64 << 20).unwrap();
            let x2 = g.tensor_from_f32(&res, 2, k).unwrap();
            let two = host(&g, &g.linear(&x2, &w, None).unwrap());
            let (gr, ur, xr) = (rounded(&gate, ty), rounded(&up, ty), rounded(&res, ty));
            let want: Vec<f32> = (0..2 * ff)
                .map(|i| {
                    let (t, row) = (i / ff, i % ff);
                    let dot = |m: &[f32]| -> f64 {
                        (0..k)
                            .map(|c| xr[t * k + c] as f64 * m[row * k + c] as f64)
                            .sum()
                    };
                    let (gv, uv) = (dot(&gr), dot(&ur));
                    (gv / (1.0 + (-gv).exp()) * uv) as f32
                })
                .collect();
            check(
                &format!("SwiGLU {ff}x{k} {ty:?}, two tokens"),
                &two,
                &want,
                1e-2,
            );
        }
    }
}

/// Attention over a paged pool: prefill chunks, decode steps and long contexts (split-K), GQA
/// groups 1 to 8, head sizes 16 to 256, blocks handed out in random order.
#[test]
fn attention_matches_cpu() {
    let mut r = rng("attention_matches_cpu");
    let shapes = [
        (9, 3, 64),
        (32, 8, 128),
        (8, 8, 128),
        (4, 2, 16),
        (4, 2, 32),
        (16, 2, 256),
    ];
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let (g, c) = (gpu(dtype), cpu());
        for &(num_heads, num_kv_heads, head_dim) in &shapes {
            let shape = AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim,
                window: None,
            };
            let kv_shape = KvShape {
                num_layers: 2,
                num_kv_heads,
                head_dim,
                format: KvSpec::default(),
            };
            let (block, pool) = (16, 400);
            let mut ckv = c.new_kv_pool(kv_shape, pool, block).unwrap();
            let mut gkv = g.new_kv_pool(kv_shape, pool, block).unwrap();
            // History: two sequences prefilled to 37 and 2900 tokens; then a step with a decode
            // token, a fresh 19-token prompt and a 5-token chunk at 2900 (split-K territory).
            let owned = layout(&mut r, &[(0, 38), (0, 19), (0, 2905)], block, pool);
            let span = |i: usize, start_pos, len| SeqSpan {
                blocks: owned.seqs[i].blocks.clone(),
                start_pos,
                len,
            };
            let hist = BatchLayout {
                seqs: vec![span(0, 0, 37), span(2, 0, 2900)],
            };
            let step = BatchLayout {
                seqs: vec![span(0, 37, 1), span(1, 0, 19), span(2, 2900, 5)],
            };
            // Then a pure decode step (the split-K kernel; batches with a prompt chunk take the
            // tensor-core prefill kernel at head_dim 64 and 128).
            let decode = BatchLayout {
                seqs: vec![span(0, 38, 1), span(1, 19, 1), span(2, 2905, 1)],
            };
            for (layer, batch) in [(0, &hist), (0, &step), (1, &hist), (1, &step), (0, &decode)] {
                let n = batch.num_tokens();
                g.poison_activations(256 << 20).unwrap();
                let q = CpuTensor::new(
                    randn(&mut r, n * num_heads * head_dim, 1.0),
                    n,
                    num_heads * head_dim,
                );
                let k = CpuTensor::new(
                    randn(&mut r, n * num_kv_heads * head_dim, 1.0),
                    n,
                    num_kv_heads * head_dim,
                );
                let v = CpuTensor::new(
                    randn(&mut r, n * num_kv_heads * head_dim, 1.0),
                    n,
                    num_kv_heads * head_dim,
                );
                let want = c
                    .attention(&q, &k, &v, &mut ckv, layer, batch, shape)
                    .unwrap();
                let (gq, gk, gv) = (to_gpu(&g, &q), to_gpu(&g, &k), to_gpu(&g, &v));
                let got = g
                    .attention(&gq, &gk, &gv, &mut gkv, layer, batch, shape)
                    .unwrap();
                check(
                    &format!("attention {shape:?} {dtype:?} {n} tokens layer {layer}"),
                    &host(&g, &got),
                    &want.data,
                    1e-2,
                );
            }
        }
    }
}

/// Sliding windows against the CPU, which masks keys with `pos - p >= window`: prompts in chunks
/// (the prefill tiers at head_dim 64 and 128, the paged kernel for every token at 256), a mixed
/// step, and decode steps (tensor-core decode for GQA at 64/128, the CUDA-core split-K kernel for
/// MHA and head_dim 256) with contexts of several splits; windows of 1 token, inside one 16-token
/// block, across tiles, and longer than the context.
#[test]
fn windowed_attention_matches_cpu() {
    let mut r = rng("windowed_attention_matches_cpu");
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let (g, c) = (gpu(dtype), cpu());
        for &(num_heads, num_kv_heads, head_dim) in &[(8, 2, 128), (4, 4, 64), (4, 1, 256)] {
            for window in [1, 7, 130, 700, 5000] {
                let shape = AttentionShape {
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    window: Some(window),
                };
                let kv_shape = KvShape {
                    num_layers: 1,
                    num_kv_heads,
                    head_dim,
                    format: KvSpec::default(),
                };
                let (block, pool) = (16, 200);
                let mut ckv = c.new_kv_pool(kv_shape, pool, block).unwrap();
                let mut gkv = g.new_kv_pool(kv_shape, pool, block).unwrap();
                let owned = layout(&mut r, &[(0, 1500), (0, 300)], block, pool);
                let span = |i: usize, start_pos, len| SeqSpan {
                    blocks: owned.seqs[i].blocks.clone(),
                    start_pos,
                    len,
                };
                let steps = [
                    vec![span(0, 0, 700), span(1, 0, 150)],
                    vec![span(0, 700, 790), span(1, 150, 140)],
                    vec![span(0, 1490, 1), span(1, 290, 9)],
                    vec![span(0, 1491, 1), span(1, 299, 1)],
                ];
                for seqs in steps {
                    let batch = BatchLayout { seqs };
                    let n = batch.num_tokens();
                    g.poison_activations(256 << 20).unwrap();
                    let mut t = |w| CpuTensor::new(randn(&mut r, n * w, 1.0), n, w);
                    let (q, k, v) = (
                        t(num_heads * head_dim),
                        t(num_kv_heads * head_dim),
                        t(num_kv_heads * head_dim),
                    );
                    let want = c.attention(&q, &k, &v, &mut ckv, 0, &batch, shape).unwrap();
                    let got = g
                        .attention(
                            &to_gpu(&g, &q),
                            &to_gpu(&g, &k),
                            &to_gpu(&g, &v),
                            &mut gkv,
                            0,
                            &batch,
                            shape,
                        )
                        .unwrap();
                    check(
                        &format!("windowed attention {shape:?} {dtype:?} {n} tokens"),
                        &host(&g, &got),
                        &want.data,
                        1e-2,
                    );
                }
            }
        }
    }
}

/// The prefill kernels, Hopper's wgmma tier (where the GPU has it) and the mma.sync tier, against
/// the CPU: a leading decode row, prompts that end inside a 128-row tile and on its edge, a chunk
/// that starts off any tile or block boundary, a chunk of at most 64 rows (one consumer
/// warpgroup), a prompt of 9 key tiles; GQA groups 4 and 3 and MHA, head sizes 128 and 64.
#[test]
fn prefill_attention_tiers_match_cpu() {
    let mut r = rng("prefill_attention_tiers_match_cpu");
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let (g, c) = (gpu(dtype), cpu());
        for &(num_heads, num_kv_heads, head_dim) in &[(32, 8, 128), (6, 2, 64), (4, 4, 128)] {
            for tier in [KernelTier::Auto, KernelTier::MmaSync] {
                g.set_kernel_tier(tier);
                let shape = AttentionShape {
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    window: None,
                };
                let kv_shape = KvShape {
                    num_layers: 1,
                    num_kv_heads,
                    head_dim,
                    format: KvSpec::default(),
                };
                let (block, pool) = (16, 300);
                let mut ckv = c.new_kv_pool(kv_shape, pool, block).unwrap();
                let mut gkv = g.new_kv_pool(kv_shape, pool, block).unwrap();
                let spans = [(0, 38), (0, 256), (0, 259), (0, 1064), (0, 1100)];
                let owned = layout(&mut r, &spans, block, pool);
                let span = |i: usize, start_pos, len| SeqSpan {
                    blocks: owned.seqs[i].blocks.clone(),
                    start_pos,
                    len,
                };
                let hist = BatchLayout {
                    seqs: vec![span(0, 0, 37), span(2, 0, 130), span(3, 0, 1000)],
                };
                let step = BatchLayout {
                    seqs: vec![
                        span(0, 37, 1),
                        span(1, 0, 256),
                        span(2, 130, 129),
                        span(3, 1000, 64),
                        span(4, 0, 1100),
                    ],
                };
                for batch in [&hist, &step] {
                    let n = batch.num_tokens();
                    g.poison_activations(256 << 20).unwrap();
                    let [q, k, v] = [num_heads, num_kv_heads, num_kv_heads].map(|heads| {
                        CpuTensor::new(
                            randn(&mut r, n * heads * head_dim, 1.0),
                            n,
                            heads * head_dim,
                        )
                    });
                    let want = c.attention(&q, &k, &v, &mut ckv, 0, batch, shape).unwrap();
                    let (gq, gk, gv) = (to_gpu(&g, &q), to_gpu(&g, &k), to_gpu(&g, &v));
                    let got = g
                        .attention(&gq, &gk, &gv, &mut gkv, 0, batch, shape)
                        .unwrap();
                    check(
                        &format!("prefill attention {shape:?} {dtype:?} {tier:?} {n} tokens"),
                        &host(&g, &got),
                        &want.data,
                        1e-2,
                    );
                }
            }
        }
        g.set_kernel_tier(KernelTier::Auto);
    }
}

#[test]
fn out_of_memory_is_an_error() {
    let g = gpu(Dtype::Bf16);
    let shape = KvShape {
        num_layers: 80,
        num_kv_heads: 64,
        head_dim: 256,
        format: KvSpec::default(),
    };
    let e = g
        .new_kv_pool(shape, 1 << 20, 16)
        .err()
        .expect("far over any GPU")
        .to_string();
    assert!(e.contains("GPU memory"), "{e}");
    // The backend still works afterwards.
    let v = g.load_vector(&[1.0, 2.0]).unwrap();
    assert_eq!(g.to_host(&v).unwrap(), vec![1.0, 2.0]);
}

fn engine<B: Backend>(backend: B, dir: &std::path::Path) -> Engine<B> {
    let files = open_model(dir, None).unwrap();
    let model = Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    Engine {
        backend,
        model,
        tokenizer: files.tokenizer,
    }
}

/// Whole models, for every architecture fixture (GQA, QKV bias, QK norm, tied embeddings, llama3
/// rope scaling), with decode steps replayed from CUDA graphs, follow the CPU's greedy path
/// ([`follows_cpu_greedy`]).
///
/// (scripts/gpu-run.sh also compares 32 greedy tokens of the real default model end to end.)
#[test]
fn greedy_generation_matches_cpu() {
    for name in [
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-llama-tied-bf16",
        // Sliding windows of 6 tokens, GeGLU, post-block norms, embedding scale.
        "tiny-gemma3",
    ] {
        let g = follows_cpu_greedy(name, &fixture(name), false);
        let (replays, captures) = g.backend.graph_counts();
        assert!(
            captures >= 1 && replays >= 30,
            "{name}: {captures} captures, {replays} replays"
        );
    }
}

/// Mixture-of-experts models on the GPU (Mixtral; Qwen2-MoE with its gated shared expert;
/// Qwen3-MoE; from HF directories and from GGUF files, whose quantized blocks run dequantized):
/// the CPU's greedy path as in [`greedy_generation_matches_cpu`]. Routing reads the router's
/// logits on the host, so these steps run eagerly, never from a graph.
#[test]
fn moe_models_match_cpu() {
    for name in [
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-qwen3-moe",
        "gguf-moe/tiny-mixtral.gguf",
        "gguf-moe/tiny-qwen2-moe.gguf",
        "gguf-moe/tiny-qwen3-moe.gguf",
    ] {
        let g = follows_cpu_greedy(name, &fixture(name), true);
        assert_eq!(g.backend.graph_counts(), (0, 0), "{name} replayed a graph");
    }
}

/// The GPU engine of model `dir`, after checking it along the CPU's greedy path:
/// - the GPU's logits stay within 2e-2 and it picks the CPU's token at every step where the
///   CPU's choice is not a near-tie (top-2 gap over 0.05: bf16 cannot order closer logits, and
///   these random fixtures have flat logits);
/// - free-running greedy generation on the GPU follows the CPU's tokens up to the first near-tie.
///
/// With `routed` (mixture-of-experts models), a step may miss the bound by a routing choice: a
/// token whose top experts are a near-tie on the CPU can take another one on the GPU, and the
/// paths part from there. Such steps stay under a relative error of 1, are at most a fifth of
/// them, and count as near-ties (the test cannot see the router's margins, so it cannot tell a
/// routing flip from an error of that size; the bound on their number is what it checks).
fn follows_cpu_greedy(name: &str, dir: &std::path::Path, routed: bool) -> Engine<CudaBackend> {
    let c = engine(cpu(), dir);
    let g = engine(gpu(Dtype::Bf16), dir);
    follows_engine_greedy(name, &c, &g, routed);
    g
}

/// A teacher-forced decode on both backends: the CPU engine's greedy path of `steps` tokens
/// after `prompt`, and each backend's logits at every step along it (the prompt as one step,
/// then a token a step).
struct TeacherForced {
    prompt: Vec<u32>,
    path: Vec<u32>,
    cpu: Vec<Vec<f32>>,
    gpu: Vec<Vec<f32>>,
}

fn teacher_forced(
    c: &Engine<CpuBackend>,
    g: &Engine<CudaBackend>,
    prompt: &str,
    steps: usize,
) -> TeacherForced {
    let prompt: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let path = [prompt.clone(), greedy(c, &prompt, steps)].concat();
    let cpu = c
        .model
        .step_logits(&c.backend, &path, prompt.len())
        .unwrap();
    let gpu = g
        .model
        .step_logits(&g.backend, &path, prompt.len())
        .unwrap();
    TeacherForced {
        prompt,
        path,
        cpu,
        gpu,
    }
}

/// The GGUF type of 16-bit weights in `dtype`.
fn ggml_type(dtype: Dtype) -> GgmlType {
    match dtype {
        Dtype::Bf16 => GgmlType::BF16,
        Dtype::F16 => GgmlType::F16,
    }
}

/// [`follows_cpu_greedy`] for engines already loaded.
fn follows_engine_greedy(
    name: &str,
    c: &Engine<CpuBackend>,
    g: &Engine<CudaBackend>,
    routed: bool,
) {
    const STEPS: usize = 40;
    const TIE: f32 = 0.05;
    let TeacherForced {
        prompt,
        path,
        cpu: want,
        gpu: got,
    } = teacher_forced(c, g, "The quick brown fox", STEPS);
    let mut first_tie = STEPS;
    let mut rerouted = Vec::new();
    for (step, (w, gl)) in want.iter().zip(&got).enumerate() {
        let e = rel_err(gl, w);
        if e >= 2e-2 {
            assert!(
                routed && e < 1.0,
                "{name} step {step} logits: relative error {e:.2e} over 2e-2"
            );
            // A token whose router logits are a near-tie can take another expert here: the two
            // paths part from this step on.
            rerouted.push((step, e));
            first_tie = first_tie.min(step);
            continue;
        }
        let (cpu_tok, gap) = top2(w);
        let (gpu_tok, _) = top2(gl);
        if gap <= TIE {
            first_tie = first_tie.min(step);
        }
        if gap > TIE {
            assert_eq!(gpu_tok, cpu_tok, "{name} step {step}: gap {gap}");
        } else {
            assert!(
                w[cpu_tok] - w[gpu_tok] <= TIE,
                "{name} step {step}: GPU chose {gpu_tok}"
            );
        }
    }
    assert!(
        rerouted.len() * 5 <= STEPS,
        "{name}: logits off the CPU's at {rerouted:?}"
    );
    if !rerouted.is_empty() {
        eprintln!("{name}: logits off the CPU's (a routing near-tie) at {rerouted:?}");
    }
    let free = greedy(g, &prompt, STEPS);
    let same = free
        .iter()
        .zip(&path[prompt.len()..])
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        same >= first_tie,
        "{name}: free-running GPU left the CPU's path at {same}, first near-tie at {first_tie}"
    );
    eprintln!(
        "{name}: free-running GPU = CPU for {same} tokens (first near-tie at step {first_tie})"
    );
}

/// A decode step replayed from a graph computes exactly what the same step run eagerly does.
#[test]
fn graph_replay_equals_eager() {
    let dir = fixture("tiny-llama3");
    let mut eager = gpu(Dtype::Bf16);
    eager.graphs_enabled = false;
    let a = engine(eager, &dir);
    let b = engine(gpu(Dtype::Bf16), &dir);
    let prompt: Vec<u32> = (1..20).collect();
    assert_eq!(greedy(&a, &prompt, 48), greedy(&b, &prompt, 48));
    assert_eq!(a.backend.graph_counts(), (0, 0));
    let (replays, captures) = b.backend.graph_counts();
    assert!(
        captures >= 1 && replays >= 40,
        "{replays} replays of {captures} graphs"
    );
}

/// The serving engine on the GPU: requests of different lengths finish and leave, so decode steps
/// run at many batch sizes, padded to graph buckets; every request gets its tokens, seeded
/// sampling on the device, and a second run of the same requests gives the same tokens. Running
/// ahead (step n+1 queued, its tokens fed on the device, before step n's are read) gives the
/// same tokens and log-probabilities as lockstep, with a repetition penalty (which makes it
/// wait), and completes every request through preemption (a pool too small for all).
#[test]
fn serving_engine_on_the_gpu_is_deterministic() {
    use nibble_engine::serving::{EngineConfig, Event, LlmEngine, Request, warm_up};
    let dir = fixture("tiny-llama3");
    let run = |run_ahead: bool, num_blocks: usize| {
        let e = engine(gpu(Dtype::Bf16), &dir);
        warm_up(&e.backend, &e.model, 256, 16, 16).unwrap();
        let config = EngineConfig {
            num_blocks,
            max_num_seqs: 16,
            max_batched_tokens: 256,
            run_ahead,
            ..EngineConfig::default()
        };
        let mut llm = LlmEngine::new(e.backend, e.model, e.tokenizer, config).unwrap();
        assert_eq!(llm.runs_ahead(), run_ahead);
        for i in 0..13u64 {
            let params = SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                top_p: 0.9,
                seed: Some(i),
                repetition_penalty: if i == 5 { 1.2 } else { 1.0 },
                // Penalties that read the output make a step wait, as the repetition penalty does.
                presence_penalty: if i == 7 { 0.8 } else { 0.0 },
                frequency_penalty: if i == 9 { 0.6 } else { 0.0 },
                logit_bias: if i == 11 {
                    vec![(3, 5.0), (9, -100.0)]
                } else {
                    vec![]
                },
                ..SamplingParams::default()
            };
            let prompt: Vec<u32> = (0..3 + i as u32 * 5)
                .map(|t| 1 + (t * 7 + i as u32) % 200)
                .collect();
            let req = Request {
                prompt,
                params,
                max_tokens: 5 + i as usize * 3,
                stop: vec![],
                ignore_eos: true,
                stop_token_ids: vec![],
                logprobs: (i % 3 == 0).then_some(3),
                constraint: None,
            };
            llm.add_request(i, req).unwrap();
        }
        let mut out = vec![Vec::new(); 13];
        while llm.has_work() {
            for ev in llm.step().unwrap() {
                if let Event::Token {
                    id, token, logprob, ..
                } = ev
                {
                    assert_eq!(logprob.is_some(), id % 3 == 0);
                    let bits = logprob.map(|l| l.logprob.to_bits());
                    out[id as usize].push((token, bits));
                }
            }
        }
        let (replays, _) = llm.backend.graph_counts();
        let stats = llm.stats();
        assert_eq!(stats.blocks_in_use, 0, "every block comes back");
        (out, replays, stats.preemptions)
    };
    let (a, replays, _) = run(false, 256);
    for (i, toks) in a.iter().enumerate() {
        assert_eq!(toks.len(), 5 + i * 3, "request {i}");
    }
    assert!(replays > 0, "no decode step replayed a graph");
    assert_eq!(a, run(false, 256).0);
    // The same batches, so the same bits: fed tokens are the sampled ones.
    assert_eq!(a, run(true, 256).0, "running ahead changed the output");
    // 12 blocks of 16 tokens for 16 sequences of up to 104 tokens. Batches now differ between
    // the two (blocks freed a step later when running ahead), and the GPU's rounding depends on
    // the batch, so only completeness is compared; the CPU tests compare the tokens.
    let (small, _, preempted) = run(true, 12);
    assert!(preempted > 0, "nothing was preempted");
    for (i, toks) in small.iter().enumerate() {
        assert_eq!(toks.len(), 5 + i * 3, "request {i} with preemption");
    }
}
