//! Tensor parallelism's arithmetic on the CPU (nibble_model::tensor_parallel,
//! nibble_cpu::tensor_parallel): N ranks, each holding a shard (its heads, its KV heads, its
//! slice of the feed-forward), summing row-parallel outputs through an all-reduce, give what one
//! rank holding the whole model gives: logits within f32 summation-order rounding on the
//! fixtures, the same greedy text on the default model. And the splits that cannot work are
//! refused with the reason.

use std::path::PathBuf;

use nibble_cpu::CpuBackend;
use nibble_cpu::tensor_parallel::{CpuComm, run_sharded};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::sampling::argmax;
use nibble_model::tensor_parallel::{ShardedSource, check_split};
use nibble_model::{Backend, BatchLayout, LogitRows, Transformer, open_model};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures")
        .join(name)
}

/// Greedy generation of `n` tokens after `prompt`.
fn greedy<B: Backend>(b: &B, m: &Transformer<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let (mut kv, table) = m.single_sequence_kv(b, prompt.len() + n).unwrap();
    let mut toks = prompt.to_vec();
    let mut pos = 0;
    while toks.len() < prompt.len() + n {
        let len = toks.len() - pos;
        let batch = BatchLayout::single(table.clone(), pos, len);
        let l = m
            .forward(b, &toks[pos..], &batch, &mut kv, LogitRows::LastPerSeq)
            .unwrap();
        pos += len;
        toks.push(argmax(&b.to_host(&l).unwrap()));
    }
    toks[prompt.len()..].to_vec()
}

#[test]
fn sharded_fixtures_give_one_ranks_logits() {
    // Two ranks of 2 query heads and 1 KV head each; QKV biases (Qwen2), QK norms, post-block
    // norms and sliding windows (Gemma 3) among them.
    for name in [
        "tiny-llama3",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-mistral",
        // Every expert (and Qwen2-MoE's shared expert) split by its width, the router whole;
        // the Mixtral GGUF file's stacked experts sliced per expert, then per rank.
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-qwen3-moe",
        "gguf-moe/tiny-mixtral.gguf",
    ] {
        let files = open_model(&fixture(name), None).unwrap();
        let cpu = CpuBackend::new(1).unwrap();
        let whole =
            Transformer::load(&cpu, files.config.clone(), &*files.source, &mut |_, _| {}).unwrap();
        let tokens: Vec<u32> = (0..24).map(|i| 3 + (i * 37) % 200).collect();
        let want = whole.step_logits(&cpu, &tokens, 9).unwrap();
        let got = run_sharded(2, 1, &*files.source, &files.config, |b, m| {
            m.step_logits(&b, &tokens, 9)
        })
        .unwrap();
        assert_eq!(got[0], got[1], "{name}: ranks disagree");
        for (step, (g, w)) in got[0].iter().zip(&want).enumerate() {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= 1e-4 * scale.max(1.0),
                "{name} step {step}: max |diff| {diff}"
            );
        }
    }
}

#[test]
fn sharded_default_model_writes_the_same_greedy_text() {
    // SmolLM2-135M (9 heads, 3 KV heads, Q4_1 blocks of 32) over 3 ranks: each holds 3 heads, 1
    // KV head, and o_proj / down_proj columns of 6 and 16 whole blocks.
    let path = nibble_cli::default_model::ensure().expect("default model");
    let files = open_model(&path, None).unwrap();
    let prompt = files
        .tokenizer
        .encode("The capital of France is", true)
        .unwrap();
    let cpu = CpuBackend::new(2).unwrap();
    let whole =
        Transformer::load(&cpu, files.config.clone(), &*files.source, &mut |_, _| {}).unwrap();
    let want = greedy(&cpu, &whole, &prompt, 24);
    let got = run_sharded(3, 1, &*files.source, &files.config, |b, m| {
        Ok(greedy(&b, &m, &prompt, 24))
    })
    .unwrap();
    for (rank, g) in got.iter().enumerate() {
        assert_eq!(
            g,
            &want,
            "rank {rank}: {:?} vs one rank's {:?}",
            files.tokenizer.decode(g, true),
            files.tokenizer.decode(&want, true)
        );
    }
}

#[test]
fn splits_that_cannot_work_are_refused_with_the_reason() {
    let files = open_model(&fixture("tiny-llama3"), None).unwrap();
    // 4 query heads and 2 KV heads do not split 3 ways, nor KV heads 4 ways.
    let e = check_split(&files.config, 3).unwrap_err().to_string();
    assert!(
        e.contains("num_attention_heads = 4") && e.contains("3"),
        "{e}"
    );
    let e = check_split(&files.config, 4).unwrap_err().to_string();
    assert!(e.contains("num_key_value_heads = 2"), "{e}");
    assert!(check_split(&files.config, 0).is_err());
    assert!(ShardedSource::new(&*files.source, &files.config, 2, 2).is_err());
    // Mixture-of-experts layers split every expert's width: it must divide too.
    let mut moe = open_model(&fixture("tiny-qwen2-moe"), None).unwrap().config;
    check_split(&moe, 2).unwrap();
    moe.moe.as_mut().unwrap().shared_expert_intermediate_size = Some(47);
    let e = check_split(&moe, 2).unwrap_err().to_string();
    assert!(e.contains("shared_expert_intermediate_size = 47"), "{e}");
    moe.moe.as_mut().unwrap().expert_intermediate_size = 31;
    let e = check_split(&moe, 2).unwrap_err().to_string();
    assert!(e.contains("moe_intermediate_size = 31"), "{e}");
    // A row-parallel cut through a quantization block, through a nibble group, and through a
    // format whose rows cannot be cut.
    let q4 = HostTensor {
        name: "w".into(),
        shape: vec![2, 64],
        format: WeightFormat::Ggml(GgmlType::Q4_0),
        bytes: TensorBytes::Owned(std::sync::Arc::new(vec![0u8; 2 * 2 * 18])),
    };
    let e = q4.slice_cols(0, 48).unwrap_err().to_string();
    assert!(e.contains("32-element Q4_0 block"), "{e}");
    assert_eq!(q4.slice_cols(32, 64).unwrap().shape, vec![2, 32]);
    let fmt: nibble_precision::LinearFormat = "int8-pc/a8".parse().unwrap();
    let rb = fmt.row_bytes(64).unwrap();
    let w8 = HostTensor {
        name: "w8".into(),
        shape: vec![2, 64],
        format: WeightFormat::Quant(fmt),
        bytes: TensorBytes::Owned(std::sync::Arc::new(vec![0u8; 2 * rb])),
    };
    // Per-channel INT8 rows keep their scale in every part.
    let part = w8.slice_cols(32, 64).unwrap();
    assert_eq!(part.shape, vec![2, 32]);
    assert_eq!(part.bytes.len(), 2 * fmt.row_bytes(32).unwrap());
    let g64: nibble_precision::LinearFormat = "int4-g64/a16".parse().unwrap();
    let w4 = HostTensor {
        name: "w4".into(),
        shape: vec![2, 256],
        format: WeightFormat::Quant(g64),
        bytes: TensorBytes::Owned(std::sync::Arc::new(vec![
            0u8;
            2 * g64.row_bytes(256).unwrap()
        ])),
    };
    let e = w4.slice_cols(0, 96).unwrap_err().to_string();
    assert!(e.contains("'w4'") && e.contains("cut a group of 64"), "{e}");
    assert_eq!(w4.slice_cols(128, 256).unwrap().shape, vec![2, 128]);
    let qoq: nibble_precision::LinearFormat = "qoq-g64/a8".parse().unwrap();
    let wq = HostTensor {
        name: "wq".into(),
        shape: vec![2, 256],
        format: WeightFormat::Quant(qoq),
        bytes: TensorBytes::Owned(std::sync::Arc::new(vec![
            0u8;
            2 * qoq.row_bytes(256).unwrap()
        ])),
    };
    let e = wq.slice_cols(0, 128).unwrap_err().to_string();
    assert!(e.contains("by columns"), "{e}");
    // Rows of any format split (column-parallel layers).
    assert_eq!(w8.slice_rows(1, 2).unwrap().shape, vec![1, 64]);
}

#[test]
fn a_failed_rank_ends_the_others_all_reduce_with_an_error() {
    let comm = CpuComm::new(2);
    let c2 = comm.clone();
    let waiter = std::thread::spawn(move || {
        let mut x = vec![1.0f32; 4];
        c2.all_reduce(0, &mut x)
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    comm.abort("rank 1 failed: out of memory");
    let e = waiter.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("rank 1 failed"), "{e}");
    // And two ranks that both arrive get the sum, in rank order, both of them.
    let comm = CpuComm::new(2);
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let comm = comm.clone();
                s.spawn(move || {
                    let mut out = Vec::new();
                    for round in 0..3 {
                        let mut x = vec![(r + 1) as f32 * (round + 1) as f32; 3];
                        comm.all_reduce(r, &mut x).unwrap();
                        out.extend(x);
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums[0], sums[1]);
    assert_eq!(sums[0], vec![3., 3., 3., 6., 6., 6., 9., 9., 9.]);
}
