//! GPU benchmarks, one run: the two ceilings first (HBM bandwidth by a device-to-device copy,
//! cuBLAS BF16 rate on 8192^3), then nibble's paged attention for decode and prefill shapes of
//! Llama-3-8B (32 query heads, 8 KV heads, head_dim 128), each against its floor, then whole
//! decode steps of a Llama-3-8B-shaped model with random weights, then the quantized GEMMs on
//! Llama-3-8B's layer shapes (`--qgemm`: the ceilings and those alone).
//!
//!     gpu-bench OUT.json [--quick] [--qgemm] [--kv-attention [--kv-formats=kv16,kv4]] [--prefill-attention]
//!               [--decode-steps B,B,.. [--spec SPEC]] [--moe-experts] [--dense-gemv]
//!
//! Timings are medians over repeats after warm-up, taken with the stream synchronized around
//! the timed region. The peer numbers (PyTorch SDPA) come from bench/gpu_peer.py in the same run.

use std::time::Instant;

use nibble_core::Result;
use nibble_cuda::qlinear::{Act8, KernelTier, QuantWeight, WGMMA_SMALL_TOKENS};
use nibble_cuda::{CudaBackend, CudaWeight, DeviceBuffer, Dtype, Elem};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::{
    AttentionShape, Backend, BatchLayout, KvShape, LogitRows, SeqSpan, Transformer,
};
use nibble_precision::{KvSpec, LinearFormat, WeightCodec};
use serde_json::{Value, json};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f` over `reps` runs after `warm` unmeasured ones.
fn time(
    be: &CudaBackend,
    warm: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    be.gpu.synchronize()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        be.gpu.synchronize()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(t))
}

/// Writes a run's JSON report to `path`.
fn write_report(path: &str, report: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(report).expect("json"))
        .map_err(|e| nibble_core::Error::io(path, e))
}

fn random_bits(n: usize, scale: f32, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        out.extend_from_slice(&half::bf16::from_f32(u * 2.0 * scale).to_le_bytes());
    }
    out
}

fn bf16_weight(rows: usize, cols: usize, seed: u64) -> HostTensor {
    HostTensor {
        name: format!("w{seed}"),
        shape: vec![rows, cols],
        format: WeightFormat::Ggml(GgmlType::BF16),
        bytes: TensorBytes::Owned(std::sync::Arc::new(random_bits(
            rows * cols,
            1.0 / (cols as f32).sqrt(),
            seed,
        ))),
    }
}

fn ceilings(be: &CudaBackend) -> Result<(f64, f64)> {
    let bytes = 2usize << 30;
    let src = DeviceBuffer::alloc(&be.gpu, bytes, "bench")?;
    let dst = DeviceBuffer::alloc(&be.gpu, bytes, "bench")?;
    let t = time(be, 2, 10, || be.gpu.copy(dst.ptr, src.ptr, bytes))?;
    let bandwidth = 2.0 * bytes as f64 / t;

    let n = 8192;
    let w = be.load_weight(&bf16_weight(n, n, 7))?;
    let xw = be.load_weight(&bf16_weight(n, n, 8))?;
    let x = be.weight_as_input(&xw)?;
    let t = time(be, 2, 10, || {
        be.begin_forward(&[], &BatchLayout::default())?;
        be.linear(&x, &w, None).map(|_| ())
    })?;
    let flops = 2.0 * (n as f64).powi(3) / t;
    Ok((bandwidth, flops))
}

/// Paged attention of one layer: `batch` sequences each with `ctx` tokens of context, either one
/// new token each (decode) or all `ctx` tokens at once (prefill).
/// Attention of one Llama-3-8B layer over a pool in `format`: decode (one query per sequence at
/// context `ctx`, its key and value appended) or causal prefill of `ctx` tokens.
fn attention(
    be: &CudaBackend,
    batch: usize,
    ctx: usize,
    prefill: bool,
    format: KvSpec,
    bw: f64,
    peak: f64,
) -> Result<Value> {
    let (heads, kv_heads, hd, block) = (32, 8, 128, 16);
    let shape = AttentionShape {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        window: None,
    };
    // A channel-wise format fills a block in slot order from slot 0 before it packs it, and the
    // random fill writes whole blocks: its decode reads one token more, the first of a fresh
    // block, which each timed call restarts.
    let reads = if !prefill && format.buffered() {
        ctx + 1
    } else {
        ctx
    };
    let blocks_per_seq = reads.div_ceil(block);
    let kv_shape = KvShape {
        num_layers: 1,
        num_kv_heads: kv_heads,
        head_dim: hd,
        format,
    };
    let mut kv = be.new_kv_pool(kv_shape, batch * blocks_per_seq, block)?;
    be.fill_kv_random(&kv, 11)?;
    let layout = BatchLayout {
        seqs: (0..batch)
            .map(|s| SeqSpan {
                blocks: (0..blocks_per_seq as u32)
                    .map(|b| (s * blocks_per_seq) as u32 + b)
                    .collect(),
                start_pos: if prefill { 0 } else { reads - 1 },
                len: if prefill { ctx } else { 1 },
            })
            .collect(),
    };
    let n = layout.num_tokens();
    let tokens = vec![0u32; n];
    let q = be.random_tensor(n, heads * hd, 1)?;
    let k = be.random_tensor(n, kv_heads * hd, 2)?;
    let v = be.random_tensor(n, kv_heads * hd, 3)?;
    // Decode: device time per call, CALLS calls recorded as one CUDA graph and replayed, as a
    // decode step runs them (the peer is timed with triton's do_bench_cudagraph). Each call also
    // appends the step's keys and values. Prefill (not graphed in the engine: it uploads its
    // tile list) is timed eagerly, CALLS calls back to back between synchronizations, so the
    // host's work overlaps the GPU's as in a run of prefill steps.
    const CALLS: usize = 20;
    let t = if prefill {
        time(be, 1, 5, || {
            for _ in 0..CALLS {
                be.begin_forward(&tokens, &layout)?;
                be.attention(&q, &k, &v, &mut kv, 0, &layout, shape)?;
            }
            Ok(())
        })? / CALLS as f64
    } else {
        be.begin_forward(&tokens, &layout)?;
        be.attention(&q, &k, &v, &mut kv, 0, &layout, shape)?;
        be.begin_forward(&tokens, &layout)?;
        // Planned outside the capture: every call restarts the same fresh block.
        be.plan_kv_residual(&mut kv, &layout)?;
        let t = be.time_graph(15, &mut || {
            for _ in 0..CALLS {
                be.attention(&q, &k, &v, &mut kv, 0, &layout, shape)?;
            }
            Ok(())
        });
        kv.finish_residual(t.is_ok());
        t? / CALLS as f64
    };
    let kv_bytes = (batch * ctx * nibble_cuda::CudaKv::bytes_per_token_of(kv_shape)) as f64;
    let flops = if prefill {
        4.0 * batch as f64 * (ctx as f64).powi(2) / 2.0 * (heads * hd) as f64
    } else {
        4.0 * (batch * ctx * heads * hd) as f64
    };
    let floor = (kv_bytes / bw).max(flops / peak);
    Ok(json!({
        "kind": if prefill { "prefill" } else { "decode" },
        "kv": format.to_string(),
        "batch": batch, "ctx": ctx, "ms": t * 1e3,
        "kv_bytes": kv_bytes, "bandwidth_fraction": kv_bytes / t / bw,
        "tflops": flops / t / 1e12, "floor_ms": floor * 1e3, "of_floor": floor / t,
    }))
}

/// Whole decode steps of a model with random weights: `batch` sequences at context `ctx`.
fn decode_steps(
    be: &CudaBackend,
    model: &Transformer<CudaBackend>,
    weight_bytes: f64,
    batch: usize,
    ctx: usize,
    bw: f64,
) -> Result<Value> {
    let block = 16;
    let per_seq = (ctx + 1).div_ceil(block);
    let kv_bytes_needed = (batch * per_seq * block) as f64
        * model.kv_shape().num_layers as f64
        * 2.0
        * (model.kv_shape().num_kv_heads * model.kv_shape().head_dim * 2) as f64;
    if kv_bytes_needed + weight_bytes > 0.92 * be.gpu.total_mem as f64 {
        return Ok(json!({"batch": batch, "ctx": ctx, "skipped": "KV cache does not fit"}));
    }
    let mut kv = be.new_kv_pool(model.kv_shape(), batch * per_seq, block)?;
    be.fill_kv_random(&kv, 5)?;
    let layout = BatchLayout {
        seqs: (0..batch)
            .map(|s| SeqSpan {
                blocks: (0..per_seq as u32)
                    .map(|b| (s * per_seq) as u32 + b)
                    .collect(),
                start_pos: ctx - 1,
                len: 1,
            })
            .collect(),
    };
    let tokens: Vec<u32> = (0..batch as u32).map(|i| 1000 + i).collect();
    let t = time(be, 3, 20, || {
        model
            .forward(be, &tokens, &layout, &mut kv, LogitRows::LastPerSeq)
            .map(|_| ())
    })?;
    let kv_read = kv_bytes_needed * (ctx as f64 / (per_seq * block) as f64);
    let floor = (weight_bytes + kv_read) / bw;
    Ok(json!({
        "batch": batch, "ctx": ctx, "ms": t * 1e3, "floor_ms": floor * 1e3,
        "of_floor": floor / t, "tokens_per_s": batch as f64 / t,
        "graph_replays": be.graph_counts().0,
    }))
}

/// Random rows of a quantized linear format (codes, scales and zeros drawn directly).
fn quant_weight(format: LinearFormat, n: usize, k: usize, seed: u64) -> Result<HostTensor> {
    let rb = format.row_bytes(k)?;
    let groups = format.codec.groups(k);
    let mut bytes = random_bits(n * rb / 2 + 1, 1.0, seed);
    bytes.truncate(n * rb);
    for row in bytes.chunks_exact_mut(rb) {
        match format.codec {
            WeightCodec::Int4Group { .. } => {
                let s = half::f16::from_f32(0.01).to_le_bytes();
                for g in 0..groups {
                    row[k / 2 + 2 * g..][..2].copy_from_slice(&s);
                    row[k / 2 + 2 * groups + g] &= 15;
                }
            }
            // QoQ / LiquidQuant: level-1 scales small enough that every group widens exactly
            // (as the quantizer's protective range guarantees), zeros 0..=15.
            WeightCodec::Qoq { .. } | WeightCodec::Lqq { .. } => {
                for g in 0..groups {
                    row[k / 2 + g] = 1 + row[k / 2 + g] % 8;
                    row[k / 2 + groups + g] &= 15;
                }
                let end = row.len();
                row[end - 2..].copy_from_slice(&half::f16::from_f32(0.001).to_le_bytes());
            }
            // e4m3 codes, the NaN patterns (S.1111.111) made zero, and an f32 scale.
            WeightCodec::Fp8PerChannel => {
                for b in &mut row[..k] {
                    if *b & 0x7f == 0x7f {
                        *b = 0;
                    }
                }
                row[k..].copy_from_slice(&0.001f32.to_le_bytes());
            }
            _ => row[k..].copy_from_slice(&half::f16::from_f32(0.001).to_le_bytes()),
        }
    }
    Ok(HostTensor {
        name: format!("q{seed}"),
        shape: vec![n, k],
        format: WeightFormat::Quant(format),
        bytes: TensorBytes::Owned(std::sync::Arc::new(bytes)),
    })
}

/// Device seconds per call of `f`, `calls` calls captured as one CUDA graph (the peer is timed
/// with triton's do_bench_cudagraph).
fn time_calls(be: &CudaBackend, calls: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    be.begin_forward(&[], &BatchLayout::default())?;
    for _ in 0..calls {
        f()?;
    }
    be.gpu.synchronize()?;
    be.begin_forward(&[], &BatchLayout::default())?;
    Ok(be.time_graph(10, &mut || {
        for _ in 0..calls {
            f()?;
        }
        Ok(())
    })? / calls as f64)
}

/// Copies of a `bytes`-byte weight that a benchmark cycles through so each call reads its weight
/// from HBM, as a decode step does (every layer's weights once): enough that the copies fill
/// twice the L2 cache.
fn cold_copies(be: &CudaBackend, bytes: usize) -> usize {
    (2 * be.gpu.l2_bytes).div_ceil(bytes.max(1)).max(1)
}

/// The packed weights of quantized `ws`.
fn quant_params(ws: &[CudaWeight]) -> Result<Vec<&QuantWeight>> {
    ws.iter()
        .map(|w| {
            w.quant()
                .ok_or_else(|| nibble_core::Error::InvalidArgument("weights did not pack".into()))
        })
        .collect()
}

/// The quantized GEMMs on Llama-3-8B's layer shapes: W4A16 (g128) and W8A8 (GEMM alone, and
/// with its activation quantization) against cuBLAS BF16 as the engine calls it (f32 output).
/// Outputs are bf16 for the quantized kernels, as the peer's. Every format cycles through
/// [`cold_copies`] of its weight, so no kernel reads a weight the L2 kept from the call before
/// (a 4096x4096 W4A16 layer is 9 MB; an H200's L2 holds 60).
/// `only_ms` (`--ms M,M,..`), when not empty, replaces the token counts.
fn qgemm(
    be: &CudaBackend,
    bw: f64,
    peak: f64,
    quick: bool,
    only_ms: &[usize],
) -> Result<Vec<Value>> {
    let shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)];
    let ms: &[usize] = if !only_ms.is_empty() {
        only_ms
    } else if quick {
        &[1, 16, 4096]
    } else {
        &[1, 4, 16, 32, 64, 256, 1024, 8192]
    };
    let w4: LinearFormat = "int4-g128/a16".parse()?;
    let w8: LinearFormat = "int8-pc/a8".parse()?;
    let w4a8: LinearFormat = "qoq-g128/a8".parse()?;
    let fp8: LinearFormat = "fp8-pc/afp8".parse()?;
    let w8a16: LinearFormat = "int8-pc/a16".parse()?;
    // COMET with one INT8 block of 128 channels (FMPQ puts the few outlier blocks first).
    let comet: LinearFormat = "int4-g128/a4a8-b128-n1".parse()?;
    let mut rows = Vec::new();
    for (si, &(n, k)) in shapes.iter().enumerate() {
        let copies = |host: &HostTensor| -> Result<Vec<_>> {
            let c = cold_copies(be, host.bytes.len());
            (0..c).map(|_| be.load_weight(host)).collect()
        };
        let dense = copies(&bf16_weight(n, k, 100 + si as u64))?;
        let q4 = copies(&quant_weight(w4, n, k, 200 + si as u64)?)?;
        let q8 = copies(&quant_weight(w8, n, k, 300 + si as u64)?)?;
        let q48 = copies(&quant_weight(w4a8, n, k, 400 + si as u64)?)?;
        let qf8 = copies(&quant_weight(fp8, n, k, 500 + si as u64)?)?;
        let q816 = copies(&quant_weight(w8a16, n, k, 600 + si as u64)?)?;
        // COMET's own kernel whatever NIBBLE_COMET says (=0 makes the loader dequantize).
        // Copies without the wgmma tier's packed copy (the tiled GEMM and the gemv), and with it
        // where the GPU has that tier (sm_90a; `None` elsewhere).
        let comet_host = quant_weight(comet, n, k, 700 + si as u64)?;
        let comet_copies = |wgmma: bool| {
            be.set_comet_wgmma(Some(wgmma));
            let copies = (0..cold_copies(be, comet_host.bytes.len()))
                .map(|_| {
                    be.comet_weight(std::slice::from_ref(&comet_host))?
                        .ok_or_else(|| {
                            nibble_core::Error::InvalidArgument("no COMET kernel here".into())
                        })
                })
                .collect::<Result<Vec<_>>>();
            be.set_comet_wgmma(None);
            copies
        };
        let qc = comet_copies(false)?;
        let qcw = Some(comet_copies(true)?).filter(
            |c| matches!(&c[0].data, nibble_cuda::WeightData::Comet(w) if w.wgmma.is_some()),
        );
        let p816s = quant_params(&q816)?;
        let (p4s, p8s, p48s) = (quant_params(&q4)?, quant_params(&q8)?, quant_params(&q48)?);
        let pf8s = quant_params(&qf8)?;
        let (p4, p8, p48, pf8) = (p4s[0], p8s[0], p48s[0], pf8s[0]);
        eprintln!(
            "qgemm {n}x{k}: {} bf16, {} w4a16, {} w8a8, {} w4a8 weight copies",
            dense.len(),
            p4s.len(),
            p8s.len(),
            p48s.len()
        );
        for &m in ms {
            let x = be.random_half_tensor(m, k, 7)?;
            let x8 = be.with_owned_act8(&x, Act8::Int8)?;
            let xf8 = be.with_owned_act8(&x, Act8::Fp8)?;
            let out = be.owned_tensor(m, n, Elem::Half(Dtype::Bf16))?;
            let calls = if m <= 64 { 20 } else { 3 };
            // Call i reads copy i mod copies.
            let cycle = |len: usize| {
                let mut i = 0usize;
                move || {
                    i += 1;
                    (i - 1) % len
                }
            };
            let (mut cd, mut c4, mut c8) = (cycle(dense.len()), cycle(p4s.len()), cycle(p8s.len()));
            let (mut c48, mut cf8) = (cycle(p48s.len()), cycle(pf8s.len()));
            let mut c816 = cycle(p816s.len());
            let mut cc = cycle(qc.len());
            let mut ccw = cycle(qcw.as_ref().map_or(1, Vec::len));
            let t_cublas = time_calls(be, calls, &mut || {
                be.linear(&x, &dense[cd()], None).map(|_| ())
            })?;
            let t_w4 = time_calls(be, calls, &mut || be.quant_gemm(&x, p4s[c4()], n, k, &out))?;
            let t_w8 = time_calls(be, calls, &mut || be.quant_gemm(&x8, p8s[c8()], n, k, &out))?;
            let t_w8q = time_calls(be, calls, &mut || be.quant_gemm(&x, p8s[c8()], n, k, &out))?;
            let t_w48 = time_calls(be, calls, &mut || {
                be.quant_gemm(&x8, p48s[c48()], n, k, &out)
            })?;
            let t_w48q = time_calls(be, calls, &mut || {
                be.quant_gemm(&x, p48s[c48()], n, k, &out)
            })?;
            let t_f8 = time_calls(be, calls, &mut || {
                be.quant_gemm(&xf8, pf8s[cf8()], n, k, &out)
            })?;
            let t_f8q = time_calls(be, calls, &mut || {
                be.quant_gemm(&x, pf8s[cf8()], n, k, &out)
            })?;
            let t_w816 = time_calls(be, calls, &mut || {
                be.quant_gemm(&x, p816s[c816()], n, k, &out)
            })?;
            // COMET quantizes its own input (no codes from a producer): timed with it, on the
            // tiled GEMM, for decode batches on its decode gemv, and on the wgmma tier.
            be.set_comet_gemv(Some(false));
            let t_comet = time_calls(be, calls, &mut || {
                be.linear(&x, &qc[cc()], None).map(|_| ())
            })?;
            let t_comet_gemv = if m <= nibble_cuda::comet::GEMV_MAX_TOKENS {
                be.set_comet_gemv(Some(true));
                Some(time_calls(be, calls, &mut || {
                    be.linear(&x, &qc[cc()], None).map(|_| ())
                })?)
            } else {
                None
            };
            // Past the gemv (and, for comparison, below it with the gemv off): the wgmma tier.
            be.set_comet_gemv(Some(false));
            let t_comet_wgmma = match &qcw {
                Some(qcw) => Some(time_calls(be, calls, &mut || {
                    be.linear(&x, &qcw[ccw()], None).map(|_| ())
                })?),
                None => None,
            };
            be.set_comet_gemv(None);
            // Decode and batch sizes on each tier (the default picks one per shape).
            let mut tier_ms = |tier: KernelTier| -> Result<(Option<f64>, Option<f64>)> {
                if m > WGMMA_SMALL_TOKENS {
                    return Ok((None, None));
                }
                be.set_kernel_tier(tier);
                let t4 = time_calls(be, calls, &mut || be.quant_gemm(&x, p4s[c4()], n, k, &out));
                let t8 = time_calls(be, calls, &mut || be.quant_gemm(&x8, p8s[c8()], n, k, &out));
                be.set_kernel_tier(KernelTier::Auto);
                Ok((Some(t4? * 1e3), Some(t8? * 1e3)))
            };
            let (t_w4_mma, t_w8_mma) = tier_ms(KernelTier::MmaSync)?;
            let (t_w4_hopper, t_w8_hopper) = tier_ms(KernelTier::Hopper)?;
            let flops = 2.0 * (m * n * k) as f64;
            let io = (m * k * 2 + m * n * 2) as f64;
            let w4_bytes = p4.bytes() as f64;
            let w8_bytes = p8.bytes() as f64;
            let w48_bytes = p48.bytes() as f64;
            let f8_bytes = pf8.bytes() as f64;
            let w816_bytes = p816s[0].bytes() as f64;
            let floor = |wb: f64| ((wb + io) / bw).max(flops / peak);
            let r = json!({
                "n": n, "k": k, "m": m,
                "cublas_bf16_ms": t_cublas * 1e3,
                "w4a16_ms": t_w4 * 1e3, "w8a8_ms": t_w8 * 1e3, "w8a8_with_quant_ms": t_w8q * 1e3,
                "w4a16_mma_sync_ms": t_w4_mma, "w8a8_mma_sync_ms": t_w8_mma,
                "w4a16_hopper_ms": t_w4_hopper, "w8a8_hopper_ms": t_w8_hopper,
                "w4a16_weight_bytes": w4_bytes, "w8a8_weight_bytes": w8_bytes,
                "w4a8_ms": t_w48 * 1e3, "w4a8_with_quant_ms": t_w48q * 1e3,
                "w4a8_weight_bytes": w48_bytes, "w4a8_floor_ms": floor(w48_bytes) * 1e3,
                "w4a8_tops": flops / t_w48 / 1e12,
                "w4a8_hbm_fraction": (w48_bytes + io) / t_w48 / bw,
                "nibble_fp8_ms": t_f8 * 1e3, "nibble_fp8_with_quant_ms": t_f8q * 1e3,
                "nibble_fp8_weight_bytes": f8_bytes, "nibble_fp8_floor_ms": floor(f8_bytes) * 1e3,
                "nibble_fp8_tflops": flops / t_f8 / 1e12,
                "w8a16_ms": t_w816 * 1e3, "w8a16_weight_bytes": w816_bytes,
                "w8a16_floor_ms": floor(w816_bytes) * 1e3,
                "w8a16_hbm_fraction": (w816_bytes + io) / t_w816 / bw,
                "w8a16_tflops": flops / t_w816 / 1e12,
                "comet_with_quant_ms": t_comet * 1e3,
                "comet_gemv_with_quant_ms": t_comet_gemv.map(|t| t * 1e3),
                "comet_wgmma_with_quant_ms": t_comet_wgmma.map(|t| t * 1e3),
                "weight_copies": [dense.len(), p4s.len(), p8s.len(), p48s.len(), pf8s.len(), p816s.len()],
                "w4a16_hbm_fraction": (w4_bytes + io) / t_w4 / bw,
                "w4a16_floor_ms": floor(w4_bytes) * 1e3, "w8a8_floor_ms": floor(w8_bytes) * 1e3,
                "bf16_floor_ms": floor((n * k * 2) as f64) * 1e3,
                "w4a16_tflops": flops / t_w4 / 1e12, "w8a8_tops": flops / t_w8 / 1e12,
                "cublas_tflops": flops / t_cublas / 1e12,
            });
            eprintln!("qgemm {r}");
            rows.push(r);
        }
    }
    Ok(rows)
}

/// Decode steps of Llama-3-8B-shaped models with random weights in BF16 and in the quantized
/// precisions that have GPU kernels (the engine measurement: tokens/s against BF16).
fn engine_precisions(be: &CudaBackend, bw: f64) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    for spec in ["", ":w4a16-g128", ":w8a8", ":w4a8-g128", ":fp8"] {
        let files = nibble_model::dummy::open_dummy(&format!("llama-3-8b{spec}"), 0)?;
        let before = be.weight_bytes();
        let t0 = Instant::now();
        let model = Transformer::load(be, files.config, &*files.source, &mut |_, _| {})?;
        let bytes = (be.weight_bytes() - before) as f64;
        eprintln!(
            "llama-3-8b{spec}: {:.2} GB loaded in {:.1}s",
            bytes / 1e9,
            t0.elapsed().as_secs_f64()
        );
        for &b in &[1, 16, 64] {
            let mut r = decode_steps(be, &model, bytes, b, 1024, bw)?;
            r["precision"] = json!(if spec.is_empty() { "bf16" } else { &spec[1..] });
            r["weight_bytes"] = json!(bytes);
            eprintln!("decode step {r}");
            rows.push(r);
        }
    }
    Ok(rows)
}

/// Bytes of a loaded weight as the GPU holds it.
fn loaded_bytes(w: &CudaWeight) -> Result<usize> {
    match w.quant() {
        Some(q) => Ok(q.bytes()),
        None => Ok(w.dense()?.bytes),
    }
}

/// 16-bit weights at decode sizes on Llama-3-8B's layer shapes whole (TP=1) and as one of two
/// tensor-parallel ranks holds them (TP=2): cuBLAS against nibble's dense decode gemv
/// (`dense_gemv`, TMA bulk copies, up to 4 tokens) and the persistent stream-K decode gemv
/// (`b16_gdec`, the grouped kernel over a one-item table, uploaded each call as the engine
/// would), each graph-timed over enough weight copies that every call reads HBM.
fn dense_gemv(be: &CudaBackend, bw: f64) -> Result<Vec<Value>> {
    use nibble_cuda::dense_gemv;
    use nibble_cuda::grouped::{self, GroupedRun};
    let shapes = [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("qkv/2", 3072, 4096),
        ("o/2", 4096, 2048),
        ("gate_up/2", 14336, 4096),
        ("down/2", 4096, 7168),
    ];
    let mut out = Vec::new();
    for (name, n, k) in shapes {
        let bytes = n * k * 2;
        let copies = cold_copies(be, bytes);
        let ws: Vec<CudaWeight> = (0..copies)
            .map(|c| be.load_weight(&bf16_weight(n, k, 300 + c as u64)))
            .collect::<Result<_>>()?;
        for &m in &[1usize, 2, 4, 16] {
            let x = be.random_half_tensor(m, k, 41)?;
            let y = be.owned_tensor(m, n, Elem::F32)?;
            let mut i = 0;
            let cublas = time_calls(be, copies, &mut || {
                i = (i + 1) % copies;
                be.blas_gemm(&x, &ws[i], &y)
            })?;
            // The dense gemv in its two stage sizes (32 KB is what the engine runs).
            let dense_in = |stage_kb: usize| -> Result<Option<f64>> {
                if !dense_gemv::applies(be, m, n, k) {
                    return Ok(None);
                }
                let mut i = 0;
                time_calls(be, copies, &mut || {
                    i = (i + 1) % copies;
                    dense_gemv::run_staged(be, &x, &ws[i], &y, stage_kb)
                })
                .map(Some)
            };
            let (dense, dense16) = (dense_in(32)?, dense_in(16)?);
            let kernel = grouped::pick(be, &[&ws[0]], m);
            let gemv = match kernel {
                Some(_) => {
                    let mut i = 0;
                    Some(time_calls(be, copies, &mut || {
                        i = (i + 1) % copies;
                        let runs = [GroupedRun {
                            weight: &ws[i],
                            first: 0,
                            rows: m,
                        }];
                        grouped::grouped_gemm(be, &x, &runs, &y)
                    })?)
                }
                None => None,
            };
            let row = json!({
                "layer": name, "n": n, "k": k, "tokens": m, "weight_bytes": bytes,
                "cublas_us": cublas * 1e6, "cublas_hbm_share": bytes as f64 / cublas / bw,
                "dense_us": dense.map(|t| t * 1e6),
                "dense_hbm_share": dense.map(|t| bytes as f64 / t / bw),
                "dense_16k_us": dense16.map(|t| t * 1e6),
                "gemv_kernel": kernel.map(|k| format!("{k:?}")),
                "gemv_us": gemv.map(|t| t * 1e6),
                "gemv_hbm_share": gemv.map(|t| bytes as f64 / t / bw),
            });
            eprintln!("dense gemv {name} M={m}: {row}");
            out.push(row);
        }
    }
    Ok(out)
}

/// Mixtral-8x7B's experts of one layer (hidden 4096, ffn 14336, 8 experts, top 2) in W4A16-g128,
/// W8A8 and BF16 at 1 to 64 tokens routed by a fixed pseudo-random top 2. Per format and size:
/// the two grouped GEMMs alone (gate/up over the gathered rows, down over the SiLU-gate's output)
/// replayed as a CUDA graph, their share of HBM bandwidth over the routed experts' bytes against
/// a cuBLAS BF16 GEMM of as many weight bytes, timed the same way; and the whole grouped layer
/// (`run_grouped_swiglu`: gather, table uploads, two launches, SiLU-gate) against the experts one
/// by one, host-timed with the stream synchronized, as the eager MoE steps run.
fn moe_experts(be: &CudaBackend, bw: f64) -> Result<Vec<Value>> {
    use nibble_cuda::grouped::{self, GroupedRun};
    use nibble_model::RoutedExpert;
    let (hidden, ffn, experts) = (4096usize, 14336usize, 8usize);
    let mut out = Vec::new();
    // NIBBLE_BENCH_FORMATS / NIBBLE_BENCH_TOKENS narrow the run (comma lists), and
    // NIBBLE_BENCH_TIER=mma-sync times the mma.sync tier (what W4A16 past 16 rows an expert took
    // before its four-token-tile decode gemv).
    let list = |var: &str| std::env::var(var).ok().filter(|v| !v.is_empty());
    let formats: Vec<String> = list("NIBBLE_BENCH_FORMATS").map_or_else(
        || vec!["int4-g128/a16".into(), "int8-pc/a8".into(), "bf16".into()],
        |v| v.split(',').map(|f| f.trim().to_string()).collect(),
    );
    let token_counts: Vec<usize> = match list("NIBBLE_BENCH_TOKENS") {
        None => vec![1, 2, 4, 8, 16, 32, 64, 128],
        Some(v) => v
            .split(',')
            .map(|t| t.trim().parse())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| {
                nibble_core::Error::InvalidArgument(format!("NIBBLE_BENCH_TOKENS={v}: {e}"))
            })?,
    };
    match list("NIBBLE_BENCH_TIER").as_deref() {
        None => {}
        Some("mma-sync") => be.set_kernel_tier(KernelTier::MmaSync),
        Some(other) => {
            return Err(nibble_core::Error::InvalidArgument(format!(
                "NIBBLE_BENCH_TIER={other}: the choices are mma-sync or unset"
            )));
        }
    }
    for spec in formats.iter().map(String::as_str) {
        let load = |rows: usize, cols: usize, seed: u64| -> Result<CudaWeight> {
            if spec == "bf16" {
                be.load_weight(&bf16_weight(rows, cols, seed))
            } else {
                be.load_weight(&quant_weight(spec.parse()?, rows, cols, seed)?)
            }
        };
        let mut weights = Vec::new();
        for e in 0..experts {
            let gate_up = load(2 * ffn, hidden, 900 + e as u64)?;
            let down = load(hidden, ffn, 950 + e as u64)?;
            weights.push((gate_up, down));
        }
        let expert_bytes = loaded_bytes(&weights[0].0)? + loaded_bytes(&weights[0].1)?;
        let act8 = (spec == "int8-pc/a8").then_some(Act8::Int8);
        for &tokens in &token_counts {
            // Token t takes experts (3t + 1) mod 8 and (5t + 2) mod 8 (distinct for every t).
            let mut routed = vec![Vec::new(); experts];
            for t in 0..tokens {
                let a = (3 * t + 1) % experts;
                let mut b = (5 * t + 2) % experts;
                if b == a {
                    b = (b + 1) % experts;
                }
                routed[a].push(t);
                routed[b].push(t);
            }
            let active: Vec<usize> = (0..experts).filter(|&e| !routed[e].is_empty()).collect();
            let rows: usize = active.iter().map(|&e| routed[e].len()).sum();
            let max_rows = active.iter().map(|&e| routed[e].len()).max().unwrap_or(0);
            let x = be.random_half_tensor(tokens, hidden, 31)?;
            let runs: Vec<RoutedExpert<'_, CudaWeight>> = active
                .iter()
                .map(|&e| RoutedExpert {
                    gate_up: &weights[e].0,
                    down: &weights[e].1,
                    rows: &routed[e],
                })
                .collect();
            let gate_ups: Vec<&CudaWeight> = active.iter().map(|&e| &weights[e].0).collect();
            let kernel = grouped::pick(be, &gate_ups, max_rows);
            let bytes = expert_bytes * active.len();
            // The grouped GEMMs alone, on inputs made once (with their 8-bit codes attached for
            // W8A8, as the producing kernels write them in the engine).
            let gathered_half = be.random_half_tensor(rows, hidden, 32)?;
            let act_half = be.random_half_tensor(rows, ffn, 33)?;
            let with_codes = |t: &nibble_cuda::CudaTensor| match act8 {
                Some(kind) => nibble_cuda::qlinear::with_owned_act8(be, t, kind).map(Some),
                None => Ok(None),
            };
            let (gathered_q, act_q) = (with_codes(&gathered_half)?, with_codes(&act_half)?);
            let gathered = gathered_q.as_ref().unwrap_or(&gathered_half);
            let act = act_q.as_ref().unwrap_or(&act_half);
            let counts = || active.iter().map(|&e| routed[e].len());
            let gemms = if kernel.is_some() {
                let gu_out = be.owned_tensor(rows, 2 * ffn, Elem::F32)?;
                let down_out = be.owned_tensor(rows, hidden, Elem::F32)?;
                let t = time_calls(be, 4, &mut || {
                    // As the engine runs them: both tables uploaded first, then the two kernels.
                    let runs = grouped::runs_in_order(gate_ups.iter().copied().zip(counts()));
                    let mut up = nibble_cuda::StepUpload::default();
                    let gu = grouped::GroupedGemm::new(be, rows, &runs, &mut up)?;
                    let downs: Vec<GroupedRun<'_>> =
                        grouped::runs_in_order(active.iter().map(|&e| &weights[e].1).zip(counts()));
                    let down = grouped::GroupedGemm::new(be, rows, &downs, &mut up)?;
                    let tables = be.stage_upload_all(&up)?;
                    gu.launch(be, tables, gathered, &gu_out)?;
                    down.launch(be, tables, act, &down_out)
                })?;
                Some(t)
            } else {
                None
            };
            let reset = || be.begin_forward(&[], &BatchLayout::default());
            let layer = if kernel.is_some() {
                Some(time(be, 3, 20, || {
                    reset()?;
                    be.run_grouped_swiglu(&x, &runs)?
                        .ok_or_else(|| nibble_core::Error::InvalidArgument("not grouped".into()))?;
                    Ok(())
                })?)
            } else {
                None
            };
            let one_by_one = time(be, 3, 20, || {
                reset()?;
                for r in &runs {
                    let xe = be.gather_rows(&x, r.rows);
                    let gu = be.linear(&xe, r.gate_up, None)?;
                    let halves = be.split_cols(&gu, &[ffn, ffn])?;
                    be.linear(&be.silu_mul(&halves[0], &halves[1]), r.down, None)?;
                }
                Ok(())
            })?;
            // cuBLAS BF16 over as many bytes (one weight, `tokens` rows), graph-timed as the
            // grouped GEMMs are.
            let dense = be.load_weight(&bf16_weight(bytes / (2 * hidden), hidden, 77))?;
            let bf16 = time_calls(be, 4, &mut || be.linear(&x, &dense, None).map(|_| ()))?;
            drop(dense);
            let row = json!({
                "format": spec, "tokens": tokens, "experts_routed": active.len(),
                "max_rows": max_rows, "weight_bytes": bytes,
                "kernel": kernel.map(|k| format!("{k:?}")),
                "grouped_gemms_us": gemms.map(|t| t * 1e6),
                "grouped_hbm_share": gemms.map(|t| bytes as f64 / t / bw),
                "bf16_same_bytes_us": bf16 * 1e6,
                "bf16_hbm_share": bytes as f64 / bf16 / bw,
                "grouped_layer_us": layer.map(|t| t * 1e6),
                "one_by_one_layer_us": one_by_one * 1e6,
            });
            eprintln!("moe experts {spec} {tokens} tokens: {row}");
            out.push(row);
        }
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "gpu-bench.json".into());
    let quick = args.iter().any(|a| a == "--quick");
    let only_qgemm = args.iter().any(|a| a == "--qgemm");
    let t_start = Instant::now();
    let be = CudaBackend::new(0, Dtype::Bf16)?;
    eprintln!(
        "gpu-bench on {} (kernels ready in {:.1} s)",
        be.name(),
        t_start.elapsed().as_secs_f64()
    );
    // --prefill-attention: only causal prefill attention of one Llama-3-8B layer, 1k to 16k
    // tokens, by both kernel tiers (Hopper's wgmma kernel, the mma.sync kernel).
    if args.iter().any(|a| a == "--prefill-attention") {
        let (bw, peak) = ceilings(&be)?;
        let mut rows = Vec::new();
        for &ctx in &[1024, 2048, 4096, 8192, 16384] {
            for tier in [KernelTier::Auto, KernelTier::MmaSync] {
                be.set_kernel_tier(tier);
                let mut r = attention(&be, 1, ctx, true, KvSpec::default(), bw, peak)?;
                r["tier"] = json!(format!("{tier:?}"));
                eprintln!("prefill attention ctx{ctx} {tier:?}: {r}");
                rows.push(r);
            }
        }
        be.set_kernel_tier(KernelTier::Auto);
        let report = json!({
            "device": be.name(), "hbm_bytes_per_s": bw, "cublas_bf16_flops": peak,
            "prefill_attention": rows,
        });
        write_report(&out, &report)?;
        return Ok(());
    }
    // --kv-attention: decode attention of one Llama-3-8B layer in each GPU KV format at batch 64
    // / context 4k and batch 8 / context 32k, each against kv16 in the same run.
    if args.iter().any(|a| a == "--kv-attention") {
        let (bw, peak) = ceilings(&be)?;
        // --kv-formats=kv16,kv4: only these (a profiler's run of one kernel), in the fixed order
        // below; the first of them (kv16 when listed) is the speedups' base.
        let kv_formats: Option<Vec<String>> = args
            .iter()
            .find_map(|a| a.strip_prefix("--kv-formats="))
            .map(|list| list.split(',').map(str::to_string).collect());
        let mut rows = Vec::new();
        for &(batch, ctx) in &[(64, 4096), (8, 32768)] {
            let mut base = None;
            for format in [
                "kv16", "kv8", "kvfp8", "kv4", "k8v4", "k4v8", "kv4c", "kv2c", "k8v4c",
            ]
            .into_iter()
            .filter(|f| {
                kv_formats
                    .as_ref()
                    .is_none_or(|only| only.iter().any(|o| o == f))
            }) {
                let mut r = attention(&be, batch, ctx, false, format.parse()?, bw, peak)?;
                let ms = r["ms"].as_f64().unwrap_or(f64::NAN);
                let base_ms = *base.get_or_insert(ms);
                r["speedup_vs_kv16"] = json!(base_ms / ms);
                eprintln!("kv attention b{batch} ctx{ctx} {format}: {r}");
                rows.push(r);
            }
        }
        let report = json!({
            "device": be.name(), "hbm_bytes_per_s": bw, "cublas_bf16_flops": peak,
            "kv_attention": rows,
        });
        write_report(&out, &report)?;
        return Ok(());
    }
    // Modes that time one set of kernels against the copy bandwidth and report only that:
    // --moe-experts: one Mixtral-8x7B expert layer (8 experts, top 2; W4A16-g128, W8A8, BF16)
    // at decode sizes: the grouped GEMMs, the grouped layer, the same experts one by one (the
    // fallback path), and a cuBLAS BF16 GEMM that reads as many bytes as the routed experts.
    // --dense-gemv: 16-bit decode GEMVs on the TP=1 and TP=2 layer shapes, cuBLAS against
    // nibble's dense decode gemv and the stream-K decode gemv.
    type Mode = fn(&CudaBackend, f64) -> Result<Vec<Value>>;
    let modes: [(&str, &str, Mode); 2] = [
        ("--moe-experts", "moe_experts", moe_experts),
        ("--dense-gemv", "dense_gemv", dense_gemv),
    ];
    if let Some((_, key, run)) = modes
        .iter()
        .find(|(flag, ..)| args.iter().any(|a| a == flag))
    {
        let bw = ceilings(&be)?.0;
        let mut report = json!({ "device": be.name(), "hbm_bytes_per_s": bw });
        report[*key] = Value::Array(run(&be, bw)?);
        write_report(&out, &report)?;
        return Ok(());
    }
    // --decode-steps B,B,.. [--spec SPEC]: only Llama-3-8B decode steps at those batch sizes
    // (contexts 512 and 1024; BF16 unless --spec), the engine's own rate that offline throughput
    // is held against.
    if let Some(i) = args.iter().position(|a| a == "--decode-steps") {
        let batches: Vec<usize> = args
            .get(i + 1)
            .map(|l| l.split(',').filter_map(|b| b.parse().ok()).collect())
            .unwrap_or_default();
        let bw = ceilings(&be)?.0;
        // --spec SPEC: a quantized Llama-3-8B shape instead (`w4a8-g128`, `fp8`, ..).
        let spec = args
            .iter()
            .position(|a| a == "--spec")
            .and_then(|j| args.get(j + 1))
            .map_or(String::new(), |s| format!(":{s}"));
        let files = nibble_model::dummy::open_dummy(&format!("llama-3-8b{spec}"), 0)?;
        let model = Transformer::load(&be, files.config, &*files.source, &mut |_, _| {})?;
        let weight_bytes = be.weight_bytes() as f64;
        let mut steps = Vec::new();
        for &ctx in &[512, 1024] {
            for &b in &batches {
                let r = decode_steps(&be, &model, weight_bytes, b, ctx, bw)?;
                eprintln!("decode step b{b} ctx{ctx}: {r}");
                steps.push(r);
            }
        }
        let report = json!({"device": be.name(), "hbm_bytes_per_s": bw, "decode_steps": steps});
        write_report(&out, &report)?;
        return Ok(());
    }
    let (bw, peak) = ceilings(&be)?;
    eprintln!(
        "HBM {:.0} GB/s (copy, read+write), cuBLAS BF16 {:.0} TFLOP/s",
        bw / 1e9,
        peak / 1e12
    );
    // --engine-only: the decode steps per precision without the kernel table (with --qgemm).
    let qgemm_rows = if args.iter().any(|a| a == "--engine-only") {
        Vec::new()
    } else {
        let only_ms: Vec<usize> = args
            .iter()
            .position(|a| a == "--ms")
            .and_then(|i| args.get(i + 1))
            .map(|l| l.split(',').filter_map(|m| m.parse().ok()).collect())
            .unwrap_or_default();
        qgemm(&be, bw, peak, quick, &only_ms)?
    };
    let engine_rows = if args.iter().any(|a| a == "--kernels-only") {
        Vec::new()
    } else {
        engine_precisions(&be, bw)?
    };
    if only_qgemm {
        let report = json!({
            "device": be.name(), "hbm_bytes_per_s": bw, "cublas_bf16_flops": peak,
            "qgemm": qgemm_rows, "engine_precisions": engine_rows,
        });
        write_report(&out, &report)?;
        return Ok(());
    }
    let mut attn = Vec::new();
    for &(b, ctx) in &[
        (1, 1024),
        (1, 4096),
        (8, 4096),
        (32, 4096),
        (64, 1024),
        (64, 4096),
    ] {
        let r = attention(&be, b, ctx, false, KvSpec::default(), bw, peak)?;
        eprintln!("decode attention b{b} ctx{ctx}: {r}");
        attn.push(r);
    }
    for &ctx in &[1024, 4096] {
        let r = attention(&be, 1, ctx, true, KvSpec::default(), bw, peak)?;
        eprintln!("prefill attention ctx{ctx}: {r}");
        attn.push(r);
    }
    let mut steps = Vec::new();
    if !quick {
        let files = nibble_model::dummy::open_dummy("llama-3-8b", 0)?;
        let t0 = Instant::now();
        let model = Transformer::load(&be, files.config, &*files.source, &mut |_, _| {})?;
        let weight_bytes = be.weight_bytes() as f64;
        eprintln!(
            "llama-3-8b dummy weights: {:.2} GB loaded in {:.1}s",
            weight_bytes / 1e9,
            t0.elapsed().as_secs_f64()
        );
        for &ctx in &[1024, 4096] {
            for &b in &[1, 8, 32, 128] {
                let r = decode_steps(&be, &model, weight_bytes, b, ctx, bw)?;
                eprintln!("decode step b{b} ctx{ctx}: {r}");
                steps.push(r);
            }
        }
    }
    let report = json!({
        "device": be.name(),
        "hbm_bytes_per_s": bw,
        "cublas_bf16_flops": peak,
        "attention": attn,
        "decode_steps": steps,
        "qgemm": qgemm_rows,
        "engine_precisions": engine_rows,
    });
    write_report(&out, &report)?;
    Ok(())
}
