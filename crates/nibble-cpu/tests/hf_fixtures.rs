//! Every architecture against logits from an independent float64 numpy forward (and Hugging Face
//! transformers; see crates/nibble-model/tests/fixtures/README.md).

mod common;

use common::{Loaded, argmax, expected, fixture, greedy_continue, load};
use nibble_model::{Backend, BatchLayout, LogitRows};

fn check(name: &str) {
    let Loaded {
        files,
        backend,
        model,
    } = load(&fixture(name), 2);
    let exp = expected(name);
    let (mut kv, slot) = model.single_sequence_kv(&backend, 64).unwrap();
    let n = exp.input_ids.len();
    let logits = model
        .forward(
            &backend,
            &exp.input_ids,
            &BatchLayout::single(slot.clone(), 0, n),
            &mut kv,
            LogitRows::All,
        )
        .unwrap();
    let host = backend.to_host(&logits).unwrap();
    let vocab = files.config.vocab_size;
    assert_eq!(host.len(), exp.logits.len());
    let mut worst = 0f32;
    for (a, b) in host.iter().zip(&exp.logits) {
        assert!(a.is_finite(), "{name}: non-finite logit");
        worst = worst.max((a - b).abs());
    }
    assert!(worst < 2e-4, "{name}: max |logit error| {worst}");
    eprintln!("{name}: max |logit error| {worst:e} against the float64 reference");

    // Greedy continuation through the KV cache, one token at a time.
    let first = argmax(&host[(n - 1) * vocab..n * vocab]);
    let got = greedy_continue(&backend, &model, &mut kv, &slot, first, n, exp.greedy.len());
    assert_eq!(got, exp.greedy, "{name}: greedy continuation");
}

#[test]
fn llama3_rope_scaling() {
    check("tiny-llama3");
}

#[test]
fn mistral() {
    check("tiny-mistral");
}

#[test]
fn qwen2_qkv_bias_untied_head() {
    check("tiny-qwen2");
}

#[test]
fn qwen3_qk_norm_explicit_head_dim() {
    check("tiny-qwen3");
}

#[test]
fn llama_tied_bf16_sharded() {
    check("tiny-llama-tied-bf16");
}

#[test]
fn mixtral_moe_renormalized_router_bf16() {
    check("tiny-mixtral");
}

#[test]
fn qwen2_moe_shared_expert_unnormalized_router() {
    check("tiny-qwen2-moe");
}

#[test]
fn qwen3_moe_dense_and_sparse_layers_f16() {
    check("tiny-qwen3-moe");
}

/// Sequences batched together (a prefill beside a decode step, different positions and slots)
/// give the same logits as each run alone.
#[test]
fn batched_forward_equals_separate_runs() {
    use nibble_model::SeqSpan;
    let Loaded {
        files,
        backend,
        model,
    } = load(&fixture("tiny-qwen2"), 2);
    let a: Vec<u32> = vec![72, 105, 44, 32, 110];
    let b: Vec<u32> = vec![10, 20, 30, 40, 50, 60, 70];
    let vocab = files.config.vocab_size;

    let alone = |ids: &[u32]| {
        let (mut kv, s) = model.single_sequence_kv(&backend, ids.len()).unwrap();
        let l = model
            .forward(
                &backend,
                ids,
                &BatchLayout::single(s, 0, ids.len()),
                &mut kv,
                LogitRows::All,
            )
            .unwrap();
        backend.to_host(&l).unwrap()
    };
    let (want_a, want_b) = (alone(&a), alone(&b));

    // Sequence b's first 4 tokens are already cached; then a (whole prompt) and b's remaining 3
    // tokens run in one batch.
    // Interleaved, out-of-order physical blocks (block size 4) for the two sequences.
    let mut kv = backend.new_kv_pool(model.kv_shape(), 8, 4).unwrap();
    let sa: Vec<u32> = vec![5, 1];
    let sb: Vec<u32> = vec![2, 7, 0];
    model
        .forward(
            &backend,
            &b[..4],
            &BatchLayout::single(sb.clone(), 0, 4),
            &mut kv,
            LogitRows::All,
        )
        .unwrap();
    let batch = BatchLayout {
        seqs: vec![
            SeqSpan {
                blocks: sa.clone(),
                start_pos: 0,
                len: a.len(),
            },
            SeqSpan {
                blocks: sb.clone(),
                start_pos: 4,
                len: 3,
            },
        ],
    };
    let tokens: Vec<u32> = a.iter().chain(&b[4..]).copied().collect();
    let got = backend
        .to_host(
            &model
                .forward(&backend, &tokens, &batch, &mut kv, LogitRows::All)
                .unwrap(),
        )
        .unwrap();
    let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-5);
    assert!(close(&got[..a.len() * vocab], &want_a));
    assert!(close(&got[a.len() * vocab..], &want_b[4 * vocab..]));

    // LastPerSeq picks each sequence's final row.
    let last = backend
        .to_host(
            &model
                .forward(&backend, &tokens, &batch, &mut kv, LogitRows::LastPerSeq)
                .unwrap(),
        )
        .unwrap();
    assert!(close(&last[..vocab], &want_a[(a.len() - 1) * vocab..]));
    assert!(close(&last[vocab..], &want_b[(b.len() - 1) * vocab..]));
}

/// Batch invariance at the model level: the last token's logits from one prefill of 9 tokens are
/// bitwise those from prefilling 8 and decoding the 9th (what a preempted-and-recomputed request
/// relies on to continue exactly as it would have).
#[test]
fn prefill_equals_prefill_then_decode_bitwise() {
    let Loaded {
        files,
        backend,
        model,
    } = load(&fixture("tiny-qwen2"), 2);
    let ids: Vec<u32> = vec![72, 105, 44, 32, 110, 10, 20, 30, 40];
    let run = |chunks: &[(usize, usize)]| {
        let (mut kv, table) = model.single_sequence_kv(&backend, 16).unwrap();
        let mut last = Vec::new();
        for &(start, len) in chunks {
            let l = model
                .forward(
                    &backend,
                    &ids[start..start + len],
                    &BatchLayout::single(table.clone(), start, len),
                    &mut kv,
                    LogitRows::LastPerSeq,
                )
                .unwrap();
            last = backend.to_host(&l).unwrap();
        }
        last
    };
    let whole = run(&[(0, 9)]);
    let split = run(&[(0, 8), (8, 1)]);
    assert_eq!(whole.len(), files.config.vocab_size);
    for (i, (a, b)) in whole.iter().zip(&split).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "logit {i}: {a} (one prefill) vs {b} (prefill + decode)"
        );
    }
}

/// Every quantized KV format on every architecture: logits of a 25-token sequence stay near the
/// f32 cache's, and the channel-wise formats, which read the block being filled in full
/// precision, match it bit for bit until the first 16-token block fills.
#[test]
fn quantized_kv_formats_stay_near_the_f32_cache() {
    use nibble_model::KvSpec;
    for name in [
        "tiny-llama-tied-bf16",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
    ] {
        let Loaded {
            files,
            backend,
            mut model,
        } = load(&fixture(name), 2);
        let exp = expected(name);
        let ids: Vec<u32> = exp.input_ids.iter().chain(&exp.greedy).copied().collect();
        let vocab = files.config.vocab_size;
        let mut logits = |kv: KvSpec| {
            model.kv_format = kv;
            let (mut cache, table) = model.single_sequence_kv(&backend, ids.len()).unwrap();
            let l = model
                .forward(
                    &backend,
                    &ids,
                    &BatchLayout::single(table, 0, ids.len()),
                    &mut cache,
                    LogitRows::All,
                )
                .unwrap();
            backend.to_host(&l).unwrap()
        };
        let exact = logits(KvSpec::default());
        // About 2.5x the worst error seen over the five fixtures; a mix is bounded by the
        // uniform format of its coarser side.
        for (kv, tol) in [
            ("kv8", 0.1),
            ("kvfp8", 0.5),
            ("kv4", 1.6),
            ("kv4c", 1.0),
            ("kv2c", 4.0),
            ("k8v4", 1.6),
            ("k4cv2c", 4.0),
        ] {
            let kv: KvSpec = kv.parse().unwrap();
            let got = logits(kv);
            let worst = got
                .iter()
                .zip(&exact)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if kv.keys_deferred() && kv.values_deferred() {
                assert_eq!(got[..16 * vocab], exact[..16 * vocab], "{name} {kv}");
            }
            assert!(
                worst > 0.0 && worst < tol,
                "{name} {kv}: max |logit change| {worst}"
            );
        }
    }
}

/// A MoE checkpoint whose tensors disagree with its config's expert count fails at load,
/// naming the tensor (the router, whose shape is checked before any expert is read).
#[test]
fn moe_checkpoint_with_other_expert_count_names_the_router() {
    let src = fixture("tiny-mixtral");
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&config).unwrap();
    v["num_local_experts"] = 5.into();
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    let files = nibble_model::open_model(dir.path(), None).unwrap();
    let backend = nibble_cpu::CpuBackend::new(1).unwrap();
    let e = nibble_model::Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {})
        .err()
        .expect("an expert count the tensors do not have must fail the load")
        .to_string();
    assert!(
        e.contains("model.layers.0.block_sparse_moe.gate.weight") && e.contains("[5, 64]"),
        "{e}"
    );
}
