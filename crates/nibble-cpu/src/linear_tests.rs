//! The matmul against the reference: the whole weight dequantized with `WeightFormat::dequantize`
//! and an f64-accumulated naive product, on random data for every ggml type and odd shapes.

use std::sync::Arc;

use half::{bf16, f16};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::Backend;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::qdot::{self, Kernel, QK, QMAX};
use crate::{CpuBackend, CpuTensor, CpuWeight};

/// Random bytes for `rows` rows of `cols` elements of `ty`, with every f16 scale set to a sane
/// value (random bits would give infinities and NaNs).
fn random_weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let h = |rng: &mut ChaCha8Rng, lo: f32, hi: f32| {
        f16::from_f32(rng.random_range(lo..hi)).to_le_bytes()
    };
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n)
            .flat_map(|_| rng.random_range(-1f32..1.0).to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..n).flat_map(|_| h(rng, -1.0, 1.0)).collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(rng.random_range(-1f32..1.0)).to_le_bytes())
            .collect(),
        _ => {
            let bb = ty.block_bytes();
            let mut bytes: Vec<u8> = (0..ty.bytes_for(n).unwrap())
                .map(|_| rng.random())
                .collect();
            for b in bytes.chunks_exact_mut(bb) {
                // (offset of d, offset of the min or dmin if any)
                let (d, m) = match ty {
                    GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => (0, None),
                    GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => (0, Some(2)),
                    GgmlType::Q6K => (208, None),
                    _ => unreachable!(),
                };
                b[d..d + 2].copy_from_slice(&h(rng, 0.001, 0.1));
                if let Some(m) = m {
                    b[m..m + 2].copy_from_slice(&h(rng, -0.5, 0.5));
                }
            }
            bytes
        }
    }
}

fn load(backend: &CpuBackend, ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> CpuWeight {
    let t = HostTensor {
        name: format!("w.{ty}"),
        shape: vec![rows, cols],
        format: WeightFormat::Ggml(ty),
        bytes: TensorBytes::Owned(Arc::new(bytes)),
    };
    backend.load_weight(&t).unwrap()
}

/// `x @ W^T` in f64, and the bound on the error of the activation quantization:
/// `sum_j |W[r][j]| * amax(block of j) / (2 * QMAX)`.
fn reference(x: &CpuTensor, w: &[f32], n: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (m, k) = (x.rows, x.cols);
    let (mut y, mut abs, mut qerr) = (vec![0f64; m * n], vec![0f64; m * n], vec![0f64; m * n]);
    for i in 0..m {
        let xi = x.row(i);
        let half_step: Vec<f64> = xi
            .chunks(QK)
            .flat_map(|c| {
                let amax = c.iter().fold(0f32, |a, &v| a.max(v.abs())) as f64;
                std::iter::repeat_n(amax / (2.0 * QMAX as f64), c.len())
            })
            .collect();
        for r in 0..n {
            let wr = &w[r * k..(r + 1) * k];
            for j in 0..k {
                y[i * n + r] += wr[j] as f64 * xi[j] as f64;
                abs[i * n + r] += (wr[j] as f64 * xi[j] as f64).abs();
                qerr[i * n + r] += (wr[j] as f64).abs() * half_step[j];
            }
        }
    }
    (y, abs, qerr)
}

fn check(ty: GgmlType, m: usize, n: usize, k: usize, quantized_x: bool, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let backend = CpuBackend::new(2).unwrap();
    let w = load(&backend, ty, n, k, random_weight(ty, n, k, &mut rng));
    let mut wf = vec![0f32; n * k];
    w.dequantize_rows(0, n, &mut wf).unwrap();
    let mut xd: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2f32..2.0)).collect();
    if quantized_x {
        // Activations that the integer blocks hold exactly: d * q with |q| <= QMAX, one |q| = QMAX.
        let qmax = QMAX as i32;
        for c in xd.chunks_mut(QK) {
            let d = rng.random_range(1e-5f32..1e-4);
            for v in c.iter_mut() {
                *v = d * rng.random_range(-qmax..=qmax) as f32;
            }
            c[0] = d * QMAX;
        }
    }
    let x = CpuTensor::new(xd, m, k);
    let y = backend.linear(&x, &w, None).unwrap();
    let (want, abs, qerr) = reference(&x, &wf, n);
    let int = Kernel::for_format(w.format).quantizes_activations();
    for (idx, ((&g, &r), (&a, &q))) in y
        .data
        .iter()
        .zip(&want)
        .zip(abs.iter().zip(&qerr))
        .enumerate()
    {
        // f32 accumulation: a few ulps of the magnitude sum; the 8-bit activations add up to
        // `qerr` (zero for exactly representable activations, up to the rounding of d * q).
        let tol =
            2e-6 * (k as f64).sqrt() * a + 1e-6 + if int && !quantized_x { q } else { 1e-6 * a };
        let err = (g as f64 - r).abs();
        assert!(
            err <= tol,
            "{ty} m={m} n={n} k={k} quantized_x={quantized_x}: y[{}][{}] = {g}, want {r} (err {err:e} > tol {tol:e})",
            idx / n,
            idx % n
        );
    }
}

#[test]
fn matmul_matches_reference_for_every_type_and_odd_shapes() {
    let mut seed = 0;
    for ty in GgmlType::ALL {
        let be = ty.block_elems();
        let ks: &[usize] = if be == 1 {
            &[1, 7, 96, 130]
        } else {
            &[be, 3 * be, 9 * be]
        };
        for &m in &[1, 2, 3, 4, 5, 17] {
            for &k in ks {
                // 37 rows run on the calling thread, 300 x 9 blocks in parallel tiles (not a
                // multiple of the tile).
                for &n in &[1, 37, 300] {
                    for quantized_x in [false, true] {
                        seed += 1;
                        check(ty, m, n, k, quantized_x, seed);
                    }
                }
            }
        }
    }
}

/// The kernels compiled in (AVX2 in the release config) give the portable kernels' bits, for
/// every number of rows.
#[test]
fn kernels_match_portable_bitwise() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let k = 20 * QK;
    let xs: Vec<Vec<f32>> = (0..qdot::MAX_ROWS)
        .map(|_| (0..k).map(|_| rng.random_range(-3f32..3.0)).collect())
        .collect();
    let q: Vec<Vec<qdot::QBlock>> = xs
        .iter()
        .map(|x| {
            let mut q = Vec::new();
            qdot::quantize_row(x, &mut q);
            q
        })
        .collect();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let w = random_weight(ty, 1, k, &mut rng);
        let format = WeightFormat::Ggml(ty);
        let kernel = Kernel::for_format(format);
        for rows in 1..=qdot::MAX_ROWS {
            let acts: Vec<qdot::ActRow> = q[..rows].iter().map(|q| qdot::ActRow::Q8(q)).collect();
            let mut got = vec![0f32; rows];
            qdot::rows_dot(kernel, format, &w, &acts, &mut got).unwrap();
            for (r, &g) in got.iter().enumerate() {
                let want = match ty {
                    GgmlType::Q4_0 => qdot::portable::dot_q4_0::<1>(&w, [&q[r]]),
                    GgmlType::Q4_1 => qdot::portable::dot_q4_1::<1>(&w, [&q[r]]),
                    _ => qdot::portable::dot_q8_0::<1>(&w, [&q[r]]),
                }[0];
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "{ty} rows={rows} row {r}: {g} vs {want}"
                );
            }
        }
    }
    // The f32 lanes, with a tail (k not a multiple of 8).
    for len in [1, 8, 37, 256] {
        let w: Vec<f32> = (0..len).map(|_| rng.random_range(-1f32..1.0)).collect();
        let x: [&[f32]; 4] = std::array::from_fn(|r| &xs[r][..len]);
        let got = qdot::dot_f32::<4>(&w, x);
        for r in 0..4 {
            let want = qdot::portable::dot_f32::<1>(&w, [x[r]])[0];
            assert_eq!(got[r].to_bits(), want.to_bits(), "f32 len={len} row {r}");
            assert_eq!(got[r].to_bits(), crate::ops::dot(&w, x[r]).to_bits());
        }
    }
}

/// Batch invariance: every output row is bitwise what that input row gives alone, and permuting
/// the input rows permutes the output rows exactly, for every format and many batch sizes
/// (including sizes that switch between the serial and the parallel path).
#[test]
fn every_row_is_independent_of_the_batch() {
    let backend = CpuBackend::new(2).unwrap();
    let mut seed = 1000;
    for ty in GgmlType::ALL {
        let k = if ty.block_elems() == 1 { 130 } else { 512 };
        for n in [37, 300] {
            seed += 1;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let w = load(&backend, ty, n, k, random_weight(ty, n, k, &mut rng));
            for m in [1, 2, 3, 4, 5, 7, 8, 16, 33] {
                let x = CpuTensor::new(
                    (0..m * k).map(|_| rng.random_range(-2f32..2.0)).collect(),
                    m,
                    k,
                );
                let y = backend.linear(&x, &w, None).unwrap();
                for i in 0..m {
                    let xi = CpuTensor::new(x.row(i).to_vec(), 1, k);
                    let yi = backend.linear(&xi, &w, None).unwrap();
                    for (c, (a, b)) in y.row(i).iter().zip(&yi.data).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty} n={n} m={m}: y[{i}][{c}] = {a} batched, {b} alone"
                        );
                    }
                }
                // A fixed shuffle of the rows.
                let perm: Vec<usize> = if m % 7 == 0 {
                    (0..m).rev().collect()
                } else {
                    (0..m).map(|i| (i * 7 + 3) % m).collect()
                };
                let px =
                    CpuTensor::new(perm.iter().flat_map(|&i| x.row(i).to_vec()).collect(), m, k);
                let py = backend.linear(&px, &w, None).unwrap();
                for (pi, &i) in perm.iter().enumerate() {
                    let same = py
                        .row(pi)
                        .iter()
                        .zip(y.row(i))
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{ty} n={n} m={m}: permuted row {pi} (row {i}) differs"
                    );
                }
            }
        }
    }
}

/// Quantizing activations: exact for values on the grid, within half a step otherwise.
#[test]
fn activation_quantization_error_is_half_a_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let x: Vec<f32> = (0..4 * QK).map(|_| rng.random_range(-5f32..5.0)).collect();
    let mut q = Vec::new();
    qdot::quantize_row(&x, &mut q);
    for (b, c) in q.iter().zip(x.chunks(QK)) {
        let amax = c.iter().fold(0f32, |a, &v| a.max(v.abs()));
        assert_eq!(b.d, amax / QMAX);
        assert_eq!(
            b.s,
            b.d * b.qs.iter().map(|&v| v as i32).sum::<i32>() as f32
        );
        for (&v, &a) in c.iter().zip(&b.qs) {
            assert!(
                (v - b.d * a as f32).abs() <= b.d * 0.5 + v.abs() * 1e-6,
                "{v} vs {}",
                b.d * a as f32
            );
        }
    }
}

/// The decode kernels (several weight rows against one activation row) give, for every weight
/// row, the bits of the portable single-row kernel.
#[test]
fn multi_weight_row_kernels_match_single_row_bitwise() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let k = 18 * QK;
    let x: Vec<f32> = (0..k).map(|_| rng.random_range(-3f32..3.0)).collect();
    let mut q = Vec::new();
    qdot::quantize_row(&x, &mut q);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let rows: Vec<Vec<u8>> = (0..4).map(|_| random_weight(ty, 1, k, &mut rng)).collect();
        let w: [&[u8]; 4] = std::array::from_fn(|r| rows[r].as_slice());
        let got = match ty {
            GgmlType::Q4_0 => qdot::dot_q4_0_w::<4>(w, &q),
            GgmlType::Q4_1 => qdot::dot_q4_1_w::<4>(w, &q),
            _ => qdot::dot_q8_0_w::<4>(w, &q),
        };
        for r in 0..4 {
            let want = match ty {
                GgmlType::Q4_0 => qdot::portable::dot_q4_0::<1>(w[r], [&q]),
                GgmlType::Q4_1 => qdot::portable::dot_q4_1::<1>(w[r], [&q]),
                _ => qdot::portable::dot_q8_0::<1>(w[r], [&q]),
            }[0];
            assert_eq!(
                got[r].to_bits(),
                want.to_bits(),
                "{ty} weight row {r}: {} vs {want}",
                got[r]
            );
        }
    }
}

fn host(ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> HostTensor {
    HostTensor {
        name: format!("w.{ty}"),
        shape: vec![rows, cols],
        format: WeightFormat::Ggml(ty),
        bytes: TensorBytes::Owned(Arc::new(bytes)),
    }
}

/// A fused weight (q, k, v stacked) gives, column block by column block, the bits of the
/// separate weights: for the integer kernels (Q4_1, Q8_0) and the float kernel (Q6_K, F16), a
/// lone row (decode, several weight rows per pass) and batches, row counts that split the
/// 4-row passes across the parts' seams.
#[test]
fn fused_weights_match_separate_ones_bitwise() {
    let backend = CpuBackend::new(2).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q6K,
        GgmlType::F16,
    ] {
        let k = 512;
        for sizes in [vec![576, 193, 190], vec![1536, 1536], vec![5, 3]] {
            let hosts: Vec<HostTensor> = sizes
                .iter()
                .map(|&n| host(ty, n, k, random_weight(ty, n, k, &mut rng)))
                .collect();
            let fused = backend.load_fused_weight(&hosts).unwrap().unwrap();
            assert_eq!(fused.rows, sizes.iter().sum::<usize>());
            let parts: Vec<CpuWeight> = hosts
                .iter()
                .map(|h| backend.load_weight(h).unwrap())
                .collect();
            for m in [1, 3, 6] {
                let x = CpuTensor::new(
                    (0..m * k).map(|_| rng.random_range(-2f32..2.0)).collect(),
                    m,
                    k,
                );
                let y = backend.linear(&x, &fused, None).unwrap();
                let split = backend.split_cols(&y, &sizes).unwrap();
                for (j, (p, s)) in parts.iter().zip(&split).enumerate() {
                    let want = backend.linear(&x, p, None).unwrap();
                    assert_eq!((s.rows, s.cols), (m, sizes[j]));
                    let same = want
                        .data
                        .iter()
                        .zip(&s.data)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{ty} parts {sizes:?} m={m}: part {j} differs");
                }
            }
            // Rows read one at a time (the embedding path) cross the seams too.
            let mut all = vec![0f32; fused.rows * k];
            fused.dequantize_rows(0, fused.rows, &mut all).unwrap();
            let mut at = 0;
            for p in &parts {
                let mut one = vec![0f32; p.rows * k];
                p.dequantize_rows(0, p.rows, &mut one).unwrap();
                assert_eq!(&all[at..at + one.len()], &one[..], "{ty} dequantized rows");
                at += one.len();
            }
        }
    }
}

/// Weights that cannot be stacked are left separate: different formats or widths, nibble's
/// quantized formats.
#[test]
fn unfusable_weights_stay_separate() {
    let backend = CpuBackend::new(1).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(78);
    let a = host(
        GgmlType::Q4_1,
        8,
        64,
        random_weight(GgmlType::Q4_1, 8, 64, &mut rng),
    );
    let b = host(
        GgmlType::Q8_0,
        8,
        64,
        random_weight(GgmlType::Q8_0, 8, 64, &mut rng),
    );
    let c = host(
        GgmlType::Q4_1,
        8,
        128,
        random_weight(GgmlType::Q4_1, 8, 128, &mut rng),
    );
    assert!(
        backend
            .load_fused_weight(&[a.clone(), b])
            .unwrap()
            .is_none()
    );
    assert!(
        backend
            .load_fused_weight(&[a.clone(), c])
            .unwrap()
            .is_none()
    );
    assert!(
        backend
            .load_fused_weight(&[a.clone(), a.clone(), a.clone(), a])
            .unwrap()
            .is_none()
    );
}

/// The matmul's bits do not depend on how many threads share it, nor on whether the helpers are
/// the spinning workers or (when another matmul holds them) rayon jobs.
#[test]
fn results_are_the_same_on_any_threads() {
    let one = CpuBackend::new(1).unwrap();
    let many = CpuBackend::new(3).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(79);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q6K] {
        let (n, k) = (1536, 768);
        let bytes = random_weight(ty, n, k, &mut rng);
        let w1 = load(&one, ty, n, k, bytes.clone());
        let wn = load(&many, ty, n, k, bytes);
        for m in [1, 5] {
            let x = CpuTensor::new(
                (0..m * k).map(|_| rng.random_range(-2f32..2.0)).collect(),
                m,
                k,
            );
            let want = one.linear(&x, &w1, None).unwrap();
            let spun = many.linear(&x, &wn, None).unwrap();
            // A matmul nested in one that holds the spinning workers takes the rayon path.
            let nested = std::sync::Mutex::new(None);
            many.pool
                .spin
                .try_run(&|| {
                    if let Ok(mut g) = nested.try_lock()
                        && g.is_none()
                    {
                        *g = Some(many.linear(&x, &wn, None).unwrap());
                    }
                })
                .unwrap();
            let nested = nested.into_inner().unwrap().unwrap();
            for (what, y) in [("spinning", &spun), ("rayon", &nested)] {
                let same = want
                    .data
                    .iter()
                    .zip(&y.data)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty} m={m}: 3 threads ({what}) differ from 1");
            }
        }
    }
}

/// Rows longer than a panel (an F32 row of 9000 elements is 36 kB) take one panel pass each.
#[test]
fn rows_wider_than_a_panel() {
    for (m, seed) in [(1, 901), (3, 902)] {
        check(GgmlType::F32, m, 9, 9000, false, seed);
        check(GgmlType::Q8_0, m, 9, 32 * 1100, true, seed + 10);
    }
}
