//! The quantized KV pool on the GPU (kernels/kv_pages.cuh, kv_quant.cu) against the CPU pool:
//! the records its appends write are the reference quantizer's bit for bit, and attention over it
//! (prefill, mixed steps, decode across splits, sliding windows) reads the reference's
//! dequantized values, within the rounding of the 16-bit MMA operands. Then whole models serve
//! the same greedy tokens in every GPU format alone, batched, chunked, preempted and from the
//! prefix cache.

use super::*;
use nibble_cuda::PageFormat;
use nibble_precision::kv::{TokenCodec, UintBits};

/// Every per-token format on each side at least once, mixes with a 16-bit side among them.
const FORMATS: [&str; 8] = [
    "kv8", "kv4", "kvfp8", "k8v4", "k4v8", "kfp8v4", "k16v4", "k8v16",
];

fn kv_shape(num_kv_heads: usize, head_dim: usize, format: &str) -> KvShape {
    KvShape {
        num_layers: 2,
        num_kv_heads,
        head_dim,
        format: format.parse().unwrap(),
    }
}

/// Attention over a quantized pool, CPU and GPU side by side: a history of two prefilled
/// sequences (one of 2900 tokens: many splits), a step mixing a decode row, a fresh prompt and a
/// chunk, then decode steps; GQA groups 4, 3 and 8, MHA, head sizes 128 and 64; one window.
#[test]
fn quantized_kv_attention_matches_cpu() {
    let mut r = rng("quantized_kv_attention_matches_cpu");
    attention_matches_cpu_in(&mut r, &FORMATS);
}

/// The channel-wise formats (docs/design/kv-channel-gpu.md): the same steps. A query reads its
/// own block raw (from the residual) and earlier blocks packed, blocks fill inside a prompt and
/// across decode steps, and the two layers keep their residuals apart.
#[test]
fn channel_kv_attention_matches_cpu() {
    let mut r = rng("channel_kv_attention_matches_cpu");
    attention_matches_cpu_in(&mut r, &["kv4c", "kv2c", "k8v4c", "k4cv8"]);
}

fn attention_matches_cpu_in(r: &mut ChaCha8Rng, formats: &[&str]) {
    // Every format's module compiled side by side first, not one pool at a time.
    let specs: Vec<KvSpec> = formats.iter().map(|f| f.parse().unwrap()).collect();
    gpu(Dtype::Bf16)
        .warm_kv_kernels(&specs, &[Dtype::Bf16, Dtype::F16])
        .unwrap();
    let shapes = [
        (32, 8, 128, None),
        (6, 2, 64, None),
        (4, 4, 128, None),
        (16, 2, 128, None),
        (8, 2, 64, Some(130)),
    ];
    for (fi, format) in formats.iter().enumerate() {
        let dtypes: &[Dtype] = if fi == 0 {
            &[Dtype::Bf16, Dtype::F16]
        } else {
            &[Dtype::Bf16]
        };
        for &dtype in dtypes {
            let (g, c) = (gpu(dtype), cpu());
            for &(num_heads, num_kv_heads, head_dim, window) in &shapes {
                let shape = AttentionShape {
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    window,
                };
                let ks = kv_shape(num_kv_heads, head_dim, format);
                let (block, pool) = (16, 400);
                let mut ckv = c.new_kv_pool(ks, pool, block).unwrap();
                let mut gkv = g.new_kv_pool(ks, pool, block).unwrap();
                let owned = layout(r, &[(0, 38), (0, 19), (0, 2905)], block, pool);
                let span = |i: usize, start_pos, len| SeqSpan {
                    blocks: owned.seqs[i].blocks.clone(),
                    start_pos,
                    len,
                };
                let batches = [
                    BatchLayout {
                        seqs: vec![span(0, 0, 37), span(2, 0, 2900)],
                    },
                    BatchLayout {
                        seqs: vec![span(0, 37, 1), span(1, 0, 19), span(2, 2900, 5)],
                    },
                    BatchLayout {
                        seqs: vec![span(0, 38, 1), span(1, 19, 1), span(2, 2905, 1)],
                    },
                ];
                for (layer, batch) in [(0, &batches[0]), (1, &batches[0]), (0, &batches[1])]
                    .into_iter()
                    .chain([(0, &batches[2]), (1, &batches[1])])
                {
                    let n = batch.num_tokens();
                    g.poison_activations(256 << 20).unwrap();
                    let [q, k, v] = [num_heads, num_kv_heads, num_kv_heads].map(|heads| {
                        CpuTensor::new(randn(r, n * heads * head_dim, 1.0), n, heads * head_dim)
                    });
                    let want = c
                        .attention(&q, &k, &v, &mut ckv, layer, batch, shape)
                        .unwrap();
                    let got = g
                        .attention(
                            &to_gpu(&g, &q),
                            &to_gpu(&g, &k),
                            &to_gpu(&g, &v),
                            &mut gkv,
                            layer,
                            batch,
                            shape,
                        )
                        .unwrap();
                    check(
                        &format!("{format} attention {shape:?} {dtype:?} {n} tokens layer {layer}"),
                        &host(&g, &got),
                        &want.data,
                        1e-2,
                    );
                }
            }
        }
    }
}

/// RoPE folded into the decode attention (`Backend::rope_attention`: q rotated as it is staged,
/// the step's key before its fused append) gives the bits of the rope kernel then the attention:
/// the outputs, and the keys it appended, which the next decode step reads. The 16-bit pool and
/// quantized ones (the register-direct kernel for kv8, kv4, kvfp8 and k8v4, the dequantizing one
/// for k16v4), both pairings, head sizes 128 and 64; the deferred kv4c and MHA at 64 keep the
/// rope kernel and agree too.
#[test]
fn decode_attention_rotates_as_the_rope_kernel() {
    let mut r = rng("decode_attention_rotates_as_the_rope_kernel");
    let formats = ["kv16", "kv8", "kv4", "kvfp8", "k8v4", "k16v4", "kv4c"];
    let specs: Vec<KvSpec> = formats[1..].iter().map(|f| f.parse().unwrap()).collect();
    let g = gpu(Dtype::Bf16);
    g.warm_kv_kernels(&specs, &[Dtype::Bf16]).unwrap();
    let shapes = [
        (32, 8, 128, RopeLayout::HalfSplit),
        (6, 2, 64, RopeLayout::Interleaved),
        (16, 2, 128, RopeLayout::Interleaved),
        (8, 2, 64, RopeLayout::HalfSplit),
        (4, 4, 64, RopeLayout::HalfSplit),
    ];
    for format in formats {
        for &(num_heads, num_kv_heads, head_dim, pairing) in &shapes {
            let shape = AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim,
                window: None,
            };
            let ks = kv_shape(num_kv_heads, head_dim, format);
            let (block, pool) = (16, 400);
            let mut pools = [0, 1].map(|_| g.new_kv_pool(ks, pool, block).unwrap());
            let half = head_dim / 2;
            let inv: Vec<f32> = (0..half)
                .map(|i| 500000f64.powf(-((2 * i) as f64) / head_dim as f64) as f32)
                .collect();
            let owned = layout(&mut r, &[(0, 40), (0, 21), (0, 2907)], block, pool);
            let span = |i: usize, start_pos, len| SeqSpan {
                blocks: owned.seqs[i].blocks.clone(),
                start_pos,
                len,
            };
            let steps = [
                vec![span(0, 0, 37), span(2, 0, 2900)],
                vec![span(0, 37, 1), span(1, 0, 19), span(2, 2900, 5)],
                vec![span(0, 38, 1), span(1, 19, 1), span(2, 2905, 1)],
                vec![span(0, 39, 1), span(1, 20, 1), span(2, 2906, 1)],
            ]
            .map(|seqs| BatchLayout { seqs });
            for (step, batch) in steps.iter().enumerate() {
                let n = batch.num_tokens();
                g.poison_activations(256 << 20).unwrap();
                let inv_freq = g.load_vector(&inv).unwrap();
                let [q, k, v] = [num_heads, num_kv_heads, num_kv_heads].map(|heads| {
                    CpuTensor::new(
                        randn(&mut r, n * heads * head_dim, 1.0),
                        n,
                        heads * head_dim,
                    )
                });
                let mut outs = Vec::new();
                for (folded, kv) in pools.iter_mut().enumerate() {
                    let (mut gq, mut gk, gv) = (to_gpu(&g, &q), to_gpu(&g, &k), to_gpu(&g, &v));
                    let out = if folded == 0 {
                        g.rope_attention(
                            &mut gq, &mut gk, &gv, kv, 0, batch, shape, &inv_freq, pairing,
                        )
                    } else {
                        g.rope_qk(&mut gq, &mut gk, head_dim, batch, &inv_freq, pairing);
                        g.attention(&gq, &gk, &gv, kv, 0, batch, shape)
                    };
                    outs.push(host(&g, &out.unwrap()));
                }
                let what = format!("{format} {shape:?} {pairing:?} step {step}");
                assert!(outs[0].iter().all(|x| x.is_finite()), "{what}: not finite");
                let differ = outs[0]
                    .iter()
                    .zip(&outs[1])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differ, 0,
                    "{what}: {differ} outputs differ from the rope kernel's"
                );
            }
        }
    }
}

/// The GPU's pages hold the CPU quantizer's records, bit for bit, whichever kernel appended them
/// (the prompt's append kernel, the decode kernel's fused append): random rows with outliers, a
/// constant row (scale 0), a row of zeros. A row past the f16 range gets NaN parameters.
#[test]
fn quantized_kv_pages_are_the_cpu_records() {
    let mut r = rng("quantized_kv_pages_are_the_cpu_records");
    pages_are_the_cpu_records_in(&mut r, &["kv8", "kv4", "kvfp8", "k16v8"]);
}

/// The channel-wise formats' pages once their blocks fill: channel-wise keys and deferred values
/// packed from the residual by `kvq_pack`, the CPU quantizer's records bit for bit. A partly
/// filled block's deferred pages are not written yet.
#[test]
fn channel_kv_pages_are_the_cpu_records() {
    let mut r = rng("channel_kv_pages_are_the_cpu_records");
    pages_are_the_cpu_records_in(&mut r, &["kv4c", "kv2c", "k8v4c", "k4cv8"]);
}

fn pages_are_the_cpu_records_in(r: &mut ChaCha8Rng, formats: &[&str]) {
    let g = gpu(Dtype::Bf16);
    for &format in formats {
        for &(num_heads, num_kv_heads, head_dim) in &[(8, 2, 128), (4, 4, 64)] {
            let ks = kv_shape(num_kv_heads, head_dim, format);
            let shape = AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim,
                window: None,
            };
            let (block, pool) = (16, 64);
            let mut gkv = g.new_kv_pool(ks, pool, block).unwrap();
            let owned = layout(r, &[(0, 40), (0, 70)], block, pool);
            let kvw = num_kv_heads * head_dim;
            let mut written: Vec<(usize, usize, Vec<f32>, Vec<f32>)> = Vec::new(); // (seq, pos, k, v)
            let steps = [vec![(0, 0, 33), (1, 0, 64)], vec![(0, 33, 1), (1, 64, 1)]];
            for (si, step) in steps.iter().enumerate() {
                let batch = BatchLayout {
                    seqs: step
                        .iter()
                        .map(|&(i, start_pos, len)| SeqSpan {
                            blocks: owned.seqs[i].blocks.clone(),
                            start_pos,
                            len,
                        })
                        .collect(),
                };
                let n = batch.num_tokens();
                let mut k = randn(r, n * kvw, 1.0);
                let mut v = randn(r, n * kvw, 1.0);
                // Outliers, a constant head and a zero head in the prompt; a large decode key.
                if si == 0 {
                    k[5] = 40.0;
                    v[kvw + 3] = -25.0;
                    k[2 * kvw..2 * kvw + head_dim].fill(0.75);
                    v[3 * kvw..3 * kvw + head_dim].fill(0.0);
                } else {
                    k[head_dim / 2] = 3000.0;
                }
                let q = randn(r, n * num_heads * head_dim, 1.0);
                g.poison_activations(256 << 20).unwrap();
                let t = |x: &[f32], w| g.tensor_from_f32(x, n, w).unwrap();
                g.attention(
                    &t(&q, num_heads * head_dim),
                    &t(&k, kvw),
                    &t(&v, kvw),
                    &mut gkv,
                    1,
                    &batch,
                    shape,
                )
                .unwrap();
                let mut row = 0;
                for &(i, start, len) in step {
                    for p in start..start + len {
                        written.push((
                            i,
                            p,
                            k[row * kvw..(row + 1) * kvw].to_vec(),
                            v[row * kvw..(row + 1) * kvw].to_vec(),
                        ));
                        row += 1;
                    }
                }
            }
            let pages = g.kv_pages(&gkv, 1).unwrap();
            let formats = PageFormat::of_spec(ks.format);
            let spec = ks.format;
            let deferred = [spec.keys_deferred(), spec.values_deferred()];
            // Positions whose block filled: written through its last slot.
            let ends: Vec<usize> = (0..2)
                .map(|i| {
                    written
                        .iter()
                        .filter(|w| w.0 == i)
                        .map(|w| w.1 + 1)
                        .max()
                        .unwrap_or(0)
                })
                .collect();
            let full = |seq: usize, pos: usize| (pos / block + 1) * block <= ends[seq];
            for (seq, pos, k, v) in &written {
                let blk = owned.seqs[*seq].blocks[pos / block] as usize;
                for (side, (pf, x)) in formats.iter().zip([k, v]).enumerate() {
                    if deferred[side] && !full(*seq, *pos) {
                        continue;
                    }
                    for h in 0..num_kv_heads {
                        let page_bytes = pf.page_bytes(head_dim, block);
                        let page =
                            &pages[side][(blk * num_kv_heads + h) * page_bytes..][..page_bytes];
                        let row = &x[h * head_dim..(h + 1) * head_dim];
                        let what =
                            format!("{format} ({pf:?}) seq {seq} pos {pos} head {h} side {side}");
                        match *pf {
                            PageFormat::Float => {
                                let got = &page[(pos % block) * head_dim * 2..][..head_dim * 2];
                                let want: Vec<u8> = row
                                    .iter()
                                    .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                                    .collect();
                                assert_eq!(got, &want[..], "{what}");
                            }
                            PageFormat::Token(codec) => {
                                let got = codec.page_record(page, head_dim, block, pos % block);
                                let mut want = vec![0u8; codec.record_bytes(head_dim)];
                                if codec.quantize(row, &mut want).is_ok() {
                                    assert_eq!(got, want, "{what}");
                                } else {
                                    // Past the f16 range: NaN scale (and zero), so attention
                                    // over it shows NaN as a 16-bit cache would.
                                    let s = f16::from_le_bytes([
                                        got[codec.code_bytes(head_dim)],
                                        got[codec.code_bytes(head_dim) + 1],
                                    ]);
                                    assert!(s.is_nan(), "{what}: scale {s}");
                                }
                            }
                            // A full block's keys, per channel over its 16 rows: checked once,
                            // at the block's first slot.
                            PageFormat::Channel(keys) => {
                                if pos % block != 0 {
                                    continue;
                                }
                                let rows: Vec<f32> = (0..block)
                                    .flat_map(|i| {
                                        let w = written
                                            .iter()
                                            .find(|w| w.0 == *seq && w.1 == pos + i)
                                            .expect("a full block's rows were written");
                                        w.2[h * head_dim..(h + 1) * head_dim].to_vec()
                                    })
                                    .collect();
                                let mut want = vec![0u8; keys.block_bytes(head_dim, block)];
                                keys.quantize(&rows, head_dim, block, head_dim, &mut want)
                                    .unwrap();
                                assert_eq!(page, &want[..], "{what}");
                            }
                        }
                    }
                }
            }
        }
    }
    // The pool sizes itself by its formats: kv8 stores a head's token in 132 bytes, kv4 in 68,
    // kvfp8 in 130, against 256 for bf16 at head_dim 128.
    let bytes = |f: &str| nibble_cuda::CudaKv::bytes_per_token_of(kv_shape(8, 128, f));
    assert_eq!(bytes("kv16"), 2 * 2 * 8 * 2 * 128);
    assert_eq!(bytes("kv8"), 2 * 2 * 8 * 132);
    assert_eq!(bytes("kv4"), 2 * 2 * 8 * 68);
    assert_eq!(bytes("kvfp8"), 2 * 2 * 8 * 130);
    assert_eq!(bytes("k8v4"), 2 * 8 * (132 + 68));
    // The codecs of the page formats are the CPU's.
    assert_eq!(
        PageFormat::of_spec("k8v4".parse().unwrap()),
        [
            PageFormat::Token(TokenCodec::Uint(UintBits::B8)),
            PageFormat::Token(TokenCodec::Uint(UintBits::B4))
        ]
    );
}

/// What the GPU does not store is a clear error naming it: a quantized cache, channel-wise or per
/// token, at a head size without kernels.
#[test]
fn unsupported_kv_formats_are_clear_errors() {
    let g = gpu(Dtype::Bf16);
    for format in ["kv8", "kv4c", "kv2c", "k8v2c", "k4cv8"] {
        let e = g
            .new_kv_pool(kv_shape(2, 256, format), 4, 16)
            .err()
            .unwrap_or_else(|| panic!("{format} at head_dim 256 has no kernels"))
            .to_string();
        assert!(e.contains(format) && e.contains("head_dim 256"), "{e}");
    }
}

/// A whole model serves the same greedy tokens in each GPU format whether a request runs alone,
/// batched with others, with its prompt in chunks, preempted and resumed, or with its prefix
/// from the cache (the CPU pool's invariant). The GPU's rounding depends on the batch (GEMM
/// tiles, attention splits), so tokens are compared up to the first step where the request run
/// alone had a near-tie (top-2 log-probabilities within 0.02), and log-probabilities not bit for
/// bit. The model: `tiny-dummy` (head_dim 64, GQA 2) with random weights; kv16 runs as the
/// control.
#[test]
fn quantized_kv_serving_keeps_greedy_tokens() {
    serving_keeps_greedy_tokens_in(&["kv16", "kv8", "kv4", "kvfp8", "k8v4"]);
}

/// The same for the channel-wise formats: prefix-cache hits are full blocks, so packed; a
/// preempted request's partly filled block is released with its residual and rewritten.
#[test]
fn channel_kv_serving_keeps_greedy_tokens() {
    serving_keeps_greedy_tokens_in(&["kv4c", "kv2c", "k8v4c"]);
}

fn serving_keeps_greedy_tokens_in(formats: &[&str]) {
    use nibble_engine::serving::{EngineConfig, Event, LlmEngine, Request};
    const TIE: f32 = 0.02;
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (0..9 + i * 7).map(|t| 1 + (t * 13 + i * 5) % 250).collect())
        .collect();
    let new_engine = |format: &str, config: EngineConfig| {
        let files = nibble_model::dummy::open_dummy("tiny-dummy", 7).unwrap();
        let be = gpu(Dtype::Bf16);
        let mut model =
            Transformer::load(&be, files.config, &*files.source, &mut |_, _| {}).unwrap();
        model.kv_format = format.parse().unwrap();
        LlmEngine::new(be, model, files.tokenizer, config).unwrap()
    };
    let request = |prompt: Vec<u32>| Request {
        prompt,
        params: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: 16,
        stop: vec![],
        ignore_eos: true,
        stop_token_ids: vec![],
        logprobs: Some(2),
        constraint: None,
    };
    // Runs `reqs` (id, prompt) to completion: each id's tokens and top-2 gaps.
    type Out = Vec<(u32, f32)>;
    let drive = |llm: &mut LlmEngine<CudaBackend>, reqs: &[(u64, Vec<u32>)]| {
        for (id, p) in reqs {
            llm.add_request(*id, request(p.clone())).unwrap();
        }
        let mut out: std::collections::HashMap<u64, Out> = Default::default();
        while llm.has_work() {
            for ev in llm.step().unwrap() {
                if let Event::Token {
                    id, token, logprob, ..
                } = ev
                {
                    let top = logprob.map(|l| l.top).unwrap_or_default();
                    let gap = match top.as_slice() {
                        [a, b, ..] => a.1 - b.1,
                        _ => f32::INFINITY,
                    };
                    out.entry(id).or_default().push((token, gap));
                }
            }
        }
        out
    };
    // Tokens of `got` must be those of `alone` up to alone's first near-tie.
    let same = |alone: &Out, got: &Out| {
        let upto = alone
            .iter()
            .position(|&(_, gap)| gap < TIE)
            .unwrap_or(alone.len());
        alone.len() == got.len()
            && alone[..upto]
                .iter()
                .zip(&got[..upto])
                .all(|(a, b)| a.0 == b.0)
    };
    let mut failures = Vec::new();
    for &format in formats {
        let alone: Vec<Out> = prompts
            .iter()
            .map(|p| {
                let mut e = new_engine(format, EngineConfig::default());
                drive(&mut e, &[(0, p.clone())]).remove(&0).unwrap()
            })
            .collect();
        let all: Vec<(u64, Vec<u32>)> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, p.clone()))
            .collect();
        let configs = [
            ("batched", EngineConfig::default()),
            (
                "chunked",
                EngineConfig {
                    max_batched_tokens: 24,
                    ..EngineConfig::default()
                },
            ),
            (
                "preempted",
                EngineConfig {
                    num_blocks: 10,
                    ..EngineConfig::default()
                },
            ),
        ];
        for (what, config) in configs {
            let mut e = new_engine(format, config);
            let got = drive(&mut e, &all);
            if what == "preempted" {
                assert!(
                    e.stats().preemptions > 0,
                    "{format}: the pool was meant to force preemption"
                );
            }
            for (i, want) in alone.iter().enumerate() {
                if !same(want, &got[&(i as u64)]) {
                    failures.push(format!(
                        "{format} {what} request {i}: {:?} != alone {want:?}",
                        got[&(i as u64)]
                    ));
                }
            }
        }
        // The prefix cache: the longest prompt after a request that shares its first 32 tokens.
        let long = prompts.len() - 1;
        let mut shared = prompts[long][..32].to_vec();
        shared.extend([7, 8, 9]);
        let mut e = new_engine(format, EngineConfig::default());
        drive(&mut e, &[(100, shared)]);
        let got = drive(&mut e, &[(long as u64, prompts[long].clone())]);
        assert!(e.stats().prefix_cache_hits >= 2, "{format}: no prefix hit");
        if !same(&alone[long], &got[&(long as u64)]) {
            failures.push(format!(
                "{format} prefix-cached: {:?} != alone {:?}",
                got[&(long as u64)],
                alone[long]
            ));
        }
        eprintln!(
            "{format}: alone {:?}",
            alone
                .iter()
                .map(|o| o.iter().map(|t| t.0).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
