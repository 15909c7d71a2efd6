//! Attention over every KV format, uniform and mixed, against a reference that dequantizes each
//! side of the cache with `nibble_precision`'s own functions and attends with the same arithmetic
//! order, so outputs must be bit-identical; plus chunking, batching, block reuse and refusal.

use nibble_model::{AttentionShape, BatchLayout, KvFormat, KvShape, KvSpec, SeqSpan};
use nibble_precision::kv::{KeyLayout, TokenCodec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::ops::dot;
use crate::{CpuKvCache, CpuTensor};

fn thread_pool(threads: usize) -> crate::Threads {
    crate::Threads::new(threads).unwrap()
}

fn shape(heads: usize, kv_heads: usize, hd: usize) -> AttentionShape {
    AttentionShape {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        window: None,
    }
}

/// Every uniform format, then mixes covering each way a side can be stored next to another:
/// both sides as written (`k8v4`, `kfp8v16`), deferred values only (`k4v2c`), deferred keys
/// only (`k4cv8`), both deferred with different codes (`k2cv4c`), and f32 keys next to
/// deferred values (`k16v2c`).
fn formats() -> Vec<KvSpec> {
    let mixes = ["k8v4", "kfp8v16", "k4v2c", "k4cv8", "k2cv4c", "k16v2c"];
    KvFormat::ALL
        .into_iter()
        .map(KvSpec::uniform)
        .chain(mixes.iter().map(|m| m.parse().unwrap()))
        .collect()
}

fn pool(
    format: impl Into<KvSpec>,
    s: AttentionShape,
    layers: usize,
    blocks: usize,
    bs: usize,
) -> CpuKvCache {
    CpuKvCache::new(
        KvShape {
            num_layers: layers,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            format: format.into(),
        },
        blocks,
        bs,
    )
    .unwrap()
}

fn random(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> CpuTensor {
    let data = (0..rows * cols)
        .map(|_| {
            let x: f32 = rng.random_range(-2.0..2.0);
            if rng.random_bool(0.02) { x * 10.0 } else { x }
        })
        .collect();
    CpuTensor::new(data, rows, cols)
}

/// One sequence's queries, keys and values for positions `0..len`.
struct Seq {
    q: CpuTensor,
    k: CpuTensor,
    v: CpuTensor,
}

impl Seq {
    fn new(rng: &mut ChaCha8Rng, s: AttentionShape, len: usize) -> Seq {
        let kv_row = s.num_kv_heads * s.head_dim;
        Seq {
            q: random(rng, len, s.num_heads * s.head_dim),
            k: random(rng, len, kv_row),
            v: random(rng, len, kv_row),
        }
    }

    fn rows(t: &CpuTensor, r: std::ops::Range<usize>) -> CpuTensor {
        CpuTensor::new(
            t.data[r.start * t.cols..r.end * t.cols].to_vec(),
            r.len(),
            t.cols,
        )
    }
}

/// Rows `range` of several sequences laid out one after another.
fn concat(parts: &[(&Seq, std::ops::Range<usize>)]) -> (CpuTensor, CpuTensor, CpuTensor) {
    let cat = |f: fn(&Seq) -> &CpuTensor| {
        let cols = f(parts[0].0).cols;
        let mut data = Vec::new();
        for (s, r) in parts {
            data.extend_from_slice(&Seq::rows(f(s), r.clone()).data);
        }
        let rows = data.len() / cols;
        CpuTensor::new(data, rows, cols)
    };
    (cat(|s| &s.q), cat(|s| &s.k), cat(|s| &s.v))
}

/// Runs one sequence through `pool` in chunks of the given sizes; returns every position's output.
fn run_chunks(
    tp: &crate::Threads,
    kv: &mut CpuKvCache,
    seq: &Seq,
    s: AttentionShape,
    blocks: &[u32],
    chunks: &[usize],
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        let (q, k, v) = concat(&[(seq, at..at + c)]);
        let batch = BatchLayout::single(blocks.to_vec(), at, c);
        let o = super::attention(tp, &q, &k, &v, kv, 0, &batch, s).unwrap();
        out.extend_from_slice(&o.data);
        at += c;
    }
    out
}

/// The key and value rows attention must read under `format`, as the cache defines them: the
/// rows of positions in full blocks and, for those in the query's own block of a buffered pool,
/// the residual's: raw rows of a deferred side, the written records of the other.
struct Expected {
    read_k: Vec<Vec<f32>>,
    read_v: Vec<Vec<f32>>,
    own_k: Vec<Vec<f32>>,
    own_v: Vec<Vec<f32>>,
}

fn expected_rows(format: KvSpec, seq: &Seq, s: AttentionShape, bs: usize) -> Expected {
    let (kvh, hd) = (s.num_kv_heads, s.head_dim);
    let row = kvh * hd;
    let len = seq.k.rows;
    let per_token = |codec: TokenCodec, t: &CpuTensor| -> Vec<Vec<f32>> {
        (0..len)
            .map(|p| {
                let mut out = vec![0.0; row];
                for h in 0..kvh {
                    let x = &t.row(p)[h * hd..(h + 1) * hd];
                    let mut rec = vec![0; codec.record_bytes(hd)];
                    codec.quantize(x, &mut rec).unwrap();
                    codec.dequantize(&rec, &mut out[h * hd..(h + 1) * hd]);
                }
                out
            })
            .collect()
    };
    let raw = |t: &CpuTensor| (0..len).map(|p| t.row(p).to_vec()).collect::<Vec<_>>();
    // Rows of full blocks come from the records; the partial tail is never packed.
    let full = len / bs * bs;
    let deferred = |quantized: Vec<Vec<f32>>, t: &CpuTensor| {
        let mut rows = raw(t);
        rows[..full].clone_from_slice(&quantized[..full]);
        rows
    };
    let read_k = match format.keys() {
        KeyLayout::Float => raw(&seq.k),
        KeyLayout::PerToken(codec) => per_token(codec, &seq.k),
        KeyLayout::PerChannel(keys) => {
            let mut deq = vec![0.0; len * row];
            for j in 0..len / bs {
                let block = &seq.k.data[j * bs * row..(j + 1) * bs * row];
                for h in 0..kvh {
                    let mut rec = vec![0; keys.block_bytes(hd, bs)];
                    keys.quantize(&block[h * hd..], row, bs, hd, &mut rec)
                        .unwrap();
                    keys.dequantize(&rec, bs, hd, &mut deq[j * bs * row + h * hd..], row);
                }
            }
            deferred(deq.chunks(row).map(<[f32]>::to_vec).collect(), &seq.k)
        }
    };
    let read_v = match format.values() {
        None => raw(&seq.v),
        Some(codec) if format.values_deferred() => deferred(per_token(codec, &seq.v), &seq.v),
        Some(codec) => per_token(codec, &seq.v),
    };
    let own_k = if format.keys_deferred() {
        raw(&seq.k)
    } else {
        read_k.clone()
    };
    let own_v = if format.values_deferred() {
        raw(&seq.v)
    } else {
        read_v.clone()
    };
    Expected {
        read_k,
        read_v,
        own_k,
        own_v,
    }
}

/// Plain causal attention over the expected rows, in the kernel's arithmetic order.
fn reference(format: KvSpec, seq: &Seq, s: AttentionShape, bs: usize) -> Vec<f32> {
    let e = expected_rows(format, seq, s, bs);
    let (heads, hd) = (s.num_heads, s.head_dim);
    let group = heads / s.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let len = seq.q.rows;
    let mut out = vec![0f32; len * heads * hd];
    for pos in 0..len {
        for h in 0..heads {
            let off = (h / group) * hd;
            let qv = &seq.q.row(pos)[h * hd..(h + 1) * hd];
            // Buffered pools: the query's own block from its residual.
            let own_start = if format.buffered() {
                pos / bs * bs
            } else {
                pos + 1
            };
            let row_k = |p: usize| {
                let rows = if p < own_start { &e.read_k } else { &e.own_k };
                &rows[p][off..off + hd]
            };
            let row_v = |p: usize| {
                let rows = if p < own_start { &e.read_v } else { &e.own_v };
                &rows[p][off..off + hd]
            };
            // A window keeps the keys with pos - p < window.
            let first = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let scores: Vec<f32> = (first..=pos).map(|p| dot(qv, row_k(p)) * scale).collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let w: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum = w.iter().fold(0f32, |a, b| a + b);
            let o = &mut out[(pos * heads + h) * hd..(pos * heads + h + 1) * hd];
            for (p, &wp) in (first..).zip(w.iter()) {
                for (a, b) in o.iter_mut().zip(row_v(p)) {
                    *a = wp.mul_add(*b, *a);
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|a| *a *= inv);
        }
    }
    out
}

fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{what}: element {i}: {a} vs {b}"
        );
    }
}

/// A block table that is neither contiguous nor in order, to catch position/slot mix-ups.
fn scattered_blocks(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 5 + 3) % (n as u32 + 4))
        .collect()
}

#[test]
fn every_format_reads_exactly_the_dequantized_cache() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let tp = thread_pool(2);
    let cases = [
        shape(4, 2, 8),  // GQA
        shape(3, 3, 6),  // odd head count, MHA
        shape(5, 1, 7),  // odd head count and head dim, MQA
        shape(6, 3, 16), // GQA groups of two
    ];
    for format in formats() {
        for s in cases {
            for bs in [16, 32] {
                for len in [1, 15, 16, 17, 37, 64] {
                    let seq = Seq::new(&mut rng, s, len);
                    let blocks = scattered_blocks(len.div_ceil(bs));
                    let mut kv = pool(format, s, 1, blocks.len() + 4, bs);
                    let got = run_chunks(&tp, &mut kv, &seq, s, &blocks, &[len]);
                    let want = reference(format, &seq, s, bs);
                    assert_bits_eq(&got, &want, &format!("{format} {s:?} block {bs} len {len}"));
                }
            }
        }
    }
}

/// Sliding windows over every format: the reference masks keys with `pos - p >= window`; chunked
/// runs equal the one-shot one; a window as long as the sequence is full attention, and a window
/// of one token returns each position's own value.
#[test]
fn sliding_windows_mask_the_old_keys() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let tp = thread_pool(2);
    let bs = 16;
    for format in formats() {
        for (heads, kv_heads, hd) in [(4, 2, 8), (6, 3, 16)] {
            let len = 53;
            let full = shape(heads, kv_heads, hd);
            let seq = Seq::new(&mut rng, full, len);
            let blocks = scattered_blocks(len.div_ceil(bs));
            let mut kv = pool(format, full, 1, blocks.len() + 4, bs);
            let unwindowed = run_chunks(&tp, &mut kv, &seq, full, &blocks, &[len]);
            for w in [1, 5, 16, 17, 40, 53, 1000] {
                let s = AttentionShape {
                    window: Some(w),
                    ..full
                };
                let what = format!("{format} {s:?}");
                let want = reference(format, &seq, s, bs);
                for chunks in [vec![len], vec![20, 1, 1, 16, 15], vec![1; len]] {
                    let mut kv = pool(format, s, 1, blocks.len() + 4, bs);
                    let got = run_chunks(&tp, &mut kv, &seq, s, &blocks, &chunks);
                    assert_bits_eq(&got, &want, &format!("{what} chunks {chunks:?}"));
                }
                if w >= len {
                    assert_bits_eq(&want, &unwindowed, &format!("{what} = full attention"));
                } else {
                    assert_ne!(want, unwindowed, "{what}: the window changes nothing");
                }
            }
        }
    }
    // Window 1: each query reads only its own key, so its output is its value row.
    let s = AttentionShape {
        window: Some(1),
        ..shape(2, 1, 4)
    };
    let seq = Seq::new(&mut rng, s, 9);
    let mut kv = pool(KvFormat::F16, s, 1, 2, bs);
    let got = run_chunks(&tp, &mut kv, &seq, s, &[1, 0], &[4, 5]);
    for p in 0..9 {
        for h in 0..2 {
            let o = &got[(p * 2 + h) * 4..][..4];
            for (a, b) in o.iter().zip(seq.v.row(p)) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "pos {p}: {a} vs {b}"
                );
            }
        }
    }
    let bad = AttentionShape {
        window: Some(0),
        ..s
    };
    let (q, k, v) = concat(&[(&seq, 0..1)]);
    let e = super::attention(
        &tp,
        &q,
        &k,
        &v,
        &mut kv,
        0,
        &BatchLayout::single(vec![1], 0, 1),
        bad,
    )
    .unwrap_err();
    assert!(e.to_string().contains("window"), "{e}");
}

#[test]
fn chunked_prefill_and_decode_equal_one_shot() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let tp = thread_pool(2);
    let s = shape(6, 2, 12);
    let len = 53;
    let seq = Seq::new(&mut rng, s, len);
    let bs = 16;
    let blocks = scattered_blocks(len.div_ceil(bs));
    for format in formats() {
        let one_shot = {
            let mut kv = pool(format, s, 1, blocks.len() + 4, bs);
            run_chunks(&tp, &mut kv, &seq, s, &blocks, &[len])
        };
        // Chunks that end mid-block, exactly on a block, and cross several blocks.
        for chunks in [
            vec![5, 11, 1, 16, 4, 16],
            vec![16, 16, 16, 5],
            vec![33, 20],
            vec![1; 53],
            [vec![20], vec![1; 33]].concat(),
        ] {
            assert_eq!(chunks.iter().sum::<usize>(), len);
            let mut kv = pool(format, s, 1, blocks.len() + 4, bs);
            let got = run_chunks(&tp, &mut kv, &seq, s, &blocks, &chunks);
            assert_bits_eq(&got, &one_shot, &format!("{format} chunks {chunks:?}"));
            assert_eq!(
                kv.residual_bytes(),
                if format.buffered() {
                    2 * bs * s.num_kv_heads * s.head_dim * 4
                } else {
                    0
                },
                "{format}: only the partial last block keeps a residual"
            );
        }
    }
}

/// Big enough that both the dequantization and the heads run on the pool.
#[test]
fn a_sequence_alone_equals_it_batched() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let s = shape(8, 4, 64);
    let bs = 16;
    let lens = [150, 37, 160];
    let seqs: Vec<Seq> = lens.iter().map(|&l| Seq::new(&mut rng, s, l + 2)).collect();
    // Interleaved block tables in one shared pool.
    let tables: Vec<Vec<u32>> = (0..3u32)
        .map(|i| (0..11u32).map(|j| j * 3 + i).collect())
        .collect();
    for format in formats() {
        for threads in [1, 3] {
            let tp = thread_pool(threads);
            let alone: Vec<Vec<f32>> = (0..3)
                .map(|i| {
                    let mut kv = pool(format, s, 1, 40, bs);
                    let n = lens[i];
                    run_chunks(&tp, &mut kv, &seqs[i], s, &tables[i], &[n, 1, 1])
                })
                .collect();
            let mut kv = pool(format, s, 1, 40, bs);
            let mut got: Vec<Vec<f32>> = vec![Vec::new(); 3];
            // Step 1: the three prompts in one batch; steps 2 and 3: one decode token each.
            let mut starts = [0usize; 3];
            for step in 0..3 {
                let spans: Vec<(usize, std::ops::Range<usize>)> = (0..3)
                    .map(|i| {
                        let n = if step == 0 { lens[i] } else { 1 };
                        (i, starts[i]..starts[i] + n)
                    })
                    .collect();
                let parts: Vec<(&Seq, std::ops::Range<usize>)> =
                    spans.iter().map(|(i, r)| (&seqs[*i], r.clone())).collect();
                let (q, k, v) = concat(&parts);
                let batch = BatchLayout {
                    seqs: spans
                        .iter()
                        .map(|(i, r)| SeqSpan {
                            blocks: tables[*i].clone(),
                            start_pos: r.start,
                            len: r.len(),
                        })
                        .collect(),
                };
                let o = super::attention(&tp, &q, &k, &v, &mut kv, 0, &batch, s).unwrap();
                let mut row = 0;
                for (i, r) in &spans {
                    let w = s.num_heads * s.head_dim;
                    got[*i].extend_from_slice(&o.data[row * w..(row + r.len()) * w]);
                    row += r.len();
                    starts[*i] = r.end;
                }
            }
            for i in 0..3 {
                assert_bits_eq(
                    &got[i],
                    &alone[i],
                    &format!("{format} seq {i} threads {threads}"),
                );
                let want = reference(format, &seqs[i], s, bs);
                assert_bits_eq(&got[i], &want, &format!("{format} seq {i} reference"));
            }
        }
    }
}

#[test]
fn channel_formats_read_full_precision_until_a_block_fills() {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let tp = thread_pool(2);
    let s = shape(4, 2, 16);
    let bs = 16;
    let seq = Seq::new(&mut rng, s, 20);
    let run = |format: KvSpec, len| {
        let mut kv = pool(format, s, 1, 4, bs);
        run_chunks(&tp, &mut kv, &seq, s, &[2, 0], &[len])
    };
    let f32_out = run(KvSpec::default(), 20);
    for format in [KvFormat::Int4Channel, KvFormat::Int2Channel] {
        let out = run(format.into(), 20);
        let w = s.num_heads * s.head_dim;
        // Queries in block 0 read only their own block: exactly the f32 cache.
        assert_bits_eq(
            &out[..16 * w],
            &f32_out[..16 * w],
            &format!("{format} block 0"),
        );
        // Queries in block 1 read block 0 quantized.
        assert!(
            out[16 * w..] != f32_out[16 * w..],
            "{format}: block 0 must be quantized"
        );
    }
    // The per-token formats quantize every token, the query's own included.
    assert!(run(KvFormat::Int8.into(), 5) != run(KvFormat::F16.into(), 5));
    // In a mix only the deferred side waits: f32 keys and 2c values read block 0 exactly as the
    // f32 cache does, INT8 keys next to them do not; 4c keys next to INT8 values do not either.
    let w = s.num_heads * s.head_dim;
    let mix = |m: &str| run(m.parse::<KvSpec>().unwrap(), 20);
    assert_bits_eq(
        &mix("k16v2c")[..16 * w],
        &f32_out[..16 * w],
        "k16v2c block 0",
    );
    assert!(mix("k16v2c")[16 * w..] != f32_out[16 * w..]);
    assert!(mix("k8v2c")[..16 * w] != f32_out[..16 * w]);
    assert!(mix("k4cv8")[..16 * w] != f32_out[..16 * w]);
}

#[test]
fn quantized_formats_stay_close_to_f32() {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let tp = thread_pool(2);
    let s = shape(4, 2, 32);
    let bs = 16;
    // Unit-range values without outliers: errors then follow the code width, not the
    // sharpness of a softmax over outlier scores.
    let mut unit = |cols: usize| {
        let data = (0..96 * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        CpuTensor::new(data, 96, cols)
    };
    let seq = Seq {
        q: unit(4 * 32),
        k: unit(2 * 32),
        v: unit(2 * 32),
    };
    let blocks: Vec<u32> = (0..6).collect();
    let run = |format| {
        let mut kv = pool(format, s, 1, 6, bs);
        run_chunks(&tp, &mut kv, &seq, s, &blocks, &[96])
    };
    let exact = run(KvFormat::F16);
    for (format, tol) in [
        (KvFormat::Int8, 0.015),
        (KvFormat::Fp8, 0.1),
        (KvFormat::Int4, 0.2),
        (KvFormat::Int4Channel, 0.1),
        (KvFormat::Int2Channel, 0.35),
    ] {
        let out = run(format);
        let mean_err = out
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
            / out.len() as f32;
        let max_err = out
            .iter()
            .zip(&exact)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            max_err < tol && mean_err < tol / 10.0,
            "{format}: max {max_err}, mean {mean_err}"
        );
        assert!(max_err > 0.0, "{format} must actually quantize");
    }
}

#[test]
fn non_finite_keys_and_values_are_refused_by_a_quantized_side_and_propagate_in_f32() {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let tp = thread_pool(2);
    let s = shape(2, 1, 8);
    let bs = 16;
    let seq = Seq::new(&mut rng, s, 24);
    for format in formats() {
        for (side, quantized) in [
            ("key", format.k.is_quantized()),
            ("value", format.v.is_quantized()),
        ] {
            for bad in [f32::NAN, f32::INFINITY, 1e6] {
                let what = format!("{format} {side} {bad}");
                let mut kv = pool(format, s, 1, 2, bs);
                let good = run_chunks(&tp, &mut kv, &seq, s, &[0, 1], &[10]);
                let (q, mut k, mut v) = concat(&[(&seq, 10..14)]);
                if side == "key" {
                    k.data[2 * 8 + 3] = bad;
                } else {
                    v.data[2 * 8 + 3] = bad;
                }
                let batch = BatchLayout::single(vec![0, 1], 10, 4);
                let r = super::attention(&tp, &q, &k, &v, &mut kv, 0, &batch, s);
                if quantized {
                    let err = r.unwrap_err().to_string();
                    assert!(
                        err.contains("batch row 2")
                            && err.contains(side)
                            && err.contains(&format.to_string()),
                        "{what}: {err}"
                    );
                    // Nothing was written: the sequence carries on as if the call never happened.
                    let (q, k, v) = concat(&[(&seq, 10..24)]);
                    let o = super::attention(
                        &tp,
                        &q,
                        &k,
                        &v,
                        &mut kv,
                        0,
                        &BatchLayout::single(vec![0, 1], 10, 14),
                        s,
                    )
                    .unwrap();
                    let mut fresh = pool(format, s, 1, 2, bs);
                    let want = run_chunks(&tp, &mut fresh, &seq, s, &[0, 1], &[10, 14]);
                    assert_bits_eq(
                        &[good, o.data].concat(),
                        &want,
                        &format!("{what} after refusal"),
                    );
                } else if !bad.is_nan() {
                    // Stored as given; whether an infinite key wins or vanishes depends on q.
                    r.unwrap();
                } else {
                    // Rows 0 and 1 do not see position 12; rows 2 and 3 do, and turn NaN.
                    let o = r.unwrap();
                    let w = 2 * 8;
                    assert!(o.data[..2 * w].iter().all(|x| x.is_finite()), "{what}");
                    // A NaN key poisons every score of the rows that see it; a NaN value
                    // only its own channel of their outputs.
                    for (i, x) in o.data[2 * w..].iter().enumerate() {
                        let poisoned = side == "key" || i % 8 == 3;
                        assert_eq!(x.is_nan(), poisoned, "{what}: element {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_reused_block_starts_afresh_and_releases_drop_residuals() {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let tp = thread_pool(2);
    let s = shape(4, 2, 8);
    let bs = 16;
    let a = Seq::new(&mut rng, s, 40);
    let b = Seq::new(&mut rng, s, 30);
    let row_bytes = 2 * s.num_kv_heads * s.head_dim * 4 * bs;
    for format in formats() {
        let mut kv = pool(format, s, 2, 4, bs);
        run_chunks(&tp, &mut kv, &a, s, &[0, 1, 2], &[40]);
        let residual = if format.buffered() { row_bytes } else { 0 };
        assert_eq!(
            kv.residual_bytes(),
            residual,
            "{format}: block 2 is half full"
        );
        kv.release_blocks(&[0, 1, 2]);
        assert_eq!(kv.residual_bytes(), 0, "{format}");
        // B takes the half-filled block 2 and the full block 0: both start over at slot 0.
        let got = run_chunks(&tp, &mut kv, &b, s, &[2, 0], &[9, 21]);
        let mut fresh = pool(format, s, 2, 4, bs);
        let want = run_chunks(&tp, &mut fresh, &b, s, &[2, 0], &[30]);
        assert_bits_eq(&got, &want, &format!("{format} reused blocks"));
    }
}

#[test]
fn channel_formats_refuse_out_of_order_writes() {
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let tp = thread_pool(1);
    let s = shape(2, 1, 8);
    let seq = Seq::new(&mut rng, s, 20);
    for format in formats() {
        let mut kv = pool(format, s, 1, 2, 16);
        run_chunks(&tp, &mut kv, &seq, s, &[0, 1], &[5]);
        // Skip positions 5 and 6.
        let (q, k, v) = concat(&[(&seq, 7..9)]);
        let r = super::attention(
            &tp,
            &q,
            &k,
            &v,
            &mut kv,
            0,
            &BatchLayout::single(vec![0, 1], 7, 2),
            s,
        );
        // A block never written, entered mid-way.
        let r2 = super::attention(
            &tp,
            &q,
            &k,
            &v,
            &mut kv,
            0,
            &BatchLayout::single(vec![1, 0], 7, 2),
            s,
        );
        if format.buffered() {
            let err = r.unwrap_err().to_string();
            assert!(err.contains("slot 7") && err.contains("holds 5"), "{err}");
            assert!(r2.unwrap_err().to_string().contains("holds 0"));
        } else {
            r.unwrap();
            r2.unwrap();
        }
    }
}

#[test]
fn pools_take_the_bytes_their_format_says() {
    let s = shape(9, 3, 64);
    let (blocks, bs, layers) = (10, 16, 2);
    let f32_pool = pool(KvFormat::F16, s, layers, blocks, bs);
    assert_eq!(f32_pool.bytes_per_token(), (2 * 3 * 64 * 4 * layers) as f64);
    for format in formats() {
        let kv = pool(format, s, layers, blocks, bs);
        let data = kv.bytes_per_token() * (blocks * bs) as f64;
        let flags = if format.buffered() {
            blocks * layers
        } else {
            0
        };
        assert_eq!(kv.pool_bytes(), data as usize + flags, "{format}");
        if format.k.is_quantized() && format.v.is_quantized() {
            let ratio = f32_pool.pool_bytes() as f64 / kv.pool_bytes() as f64;
            // Scales and zeros cost up to half the code bytes (kv2c at the smallest block).
            let min = 32.0 / format.k.bits().max(format.v.bits()) as f64 * 0.5;
            assert!(ratio > min, "{format}: only {ratio:.2}x smaller than f32");
        }
    }
    for format in ["kv4c", "kv2c", "k4cv8"] {
        let shape = KvShape {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 8,
            format: format.parse().unwrap(),
        };
        let err = CpuKvCache::new(shape, 4, 8).err().unwrap().to_string();
        assert!(err.contains("at least 16"), "{err}");
    }
}
