//! Mixture-of-experts models from GGUF files as llama.cpp writes them
//! (crates/nibble-model/tests/fixtures/gguf-moe/, made from the tiny MoE HF fixtures by
//! scripts/make_tiny_moe_gguf.py with the `gguf` package): the same logits as the HF directory
//! when the GGUF holds the same values, close ones for Q8_0, and clear errors for broken files.

mod common;

use std::path::{Path, PathBuf};

use common::{Loaded, argmax, expected, expected_at, fixture, greedy_continue, load};
use nibble_formats::gguf::{GgufFile, GgufWriter};
use nibble_model::{Backend, BatchLayout, LogitRows};

fn gguf(name: &str) -> PathBuf {
    fixture("gguf-moe").join(format!("{name}.gguf"))
}

/// Prompt logits (flattened) of the model at `path` on the fixture's prompt, and the greedy
/// continuation through the KV cache as long as the fixture's.
fn run(path: &Path, fixture_name: &str) -> (Vec<f32>, Vec<u32>) {
    let Loaded {
        files,
        backend,
        model,
    } = load(path, 2);
    let exp = expected(fixture_name);
    let n = exp.input_ids.len();
    let (mut kv, slot) = model.single_sequence_kv(&backend, 64).unwrap();
    let l = model
        .forward(
            &backend,
            &exp.input_ids,
            &BatchLayout::single(slot.clone(), 0, n),
            &mut kv,
            LogitRows::All,
        )
        .unwrap();
    let logits = backend.to_host(&l).unwrap();
    let vocab = files.config.vocab_size;
    let first = argmax(&logits[(n - 1) * vocab..]);
    let greedy = greedy_continue(&backend, &model, &mut kv, &slot, first, n, exp.greedy.len());
    (logits, greedy)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert!(x.is_finite() && y.is_finite());
            (x - y).abs()
        })
        .fold(0f32, f32::max)
}

/// The GGUF's logits against the HF directory's (both loaded by nibble), and when `exact`, the
/// GGUF's greedy continuation against the fixture's float64 reference. Returns the largest logit
/// difference.
fn compare(name: &str, exact: bool) -> f32 {
    let (hf, _) = run(&fixture(name), name);
    let (g, greedy) = run(&gguf(name), name);
    if exact {
        assert_eq!(greedy, expected(name).greedy, "{name}: greedy continuation");
    }
    let d = max_diff(&hf, &g);
    eprintln!("{name}: GGUF against HF directory, max |logit difference| {d:e}");
    d
}

#[test]
fn mixtral_llama_arch_bf16_stacked_experts_equals_the_hf_directory() {
    let path = gguf("tiny-mixtral");
    let cfg = nibble_model::open_model(&path, None).unwrap().config;
    assert_eq!(cfg.arch, nibble_model::Arch::Mixtral);
    let m = cfg.moe.unwrap();
    assert_eq!((m.num_experts, m.top_k, m.renormalize), (4, 2, true));
    assert_eq!(compare("tiny-mixtral", true), 0.0);
}

#[test]
fn qwen3_moe_f16_with_a_dense_layer_equals_the_hf_directory() {
    let cfg = nibble_model::open_model(&gguf("tiny-qwen3-moe"), None)
        .unwrap()
        .config;
    let m = cfg.moe.unwrap();
    assert_eq!(m.sparse_layers, vec![false, true]);
    assert!(m.renormalize);
    assert_eq!(compare("tiny-qwen3-moe", true), 0.0);
}

/// Q8_0 weights (a block of 32 values shares one f16 scale: rounding error up to 1/254 of the
/// block's largest value) move these prompt logits (std 0.91) by 0.052 from the unquantized
/// model, in numpy's float64 forward as in nibble's; the bound is Q8_0_BOUND. Against the float64
/// forward of the dequantized values (tiny-qwen2-moe.q8_0-expected.json) nibble's logits agree
/// within 3e-4 (1.8e-4 measured; unquantized fixtures: 2e-4), and so does the greedy continuation.
#[test]
fn qwen2_moe_q8_0_with_shared_expert_stays_near_the_hf_directory() {
    let name = "tiny-qwen2-moe";
    let cfg = nibble_model::open_model(&gguf(name), None).unwrap().config;
    let m = cfg.moe.unwrap();
    assert_eq!(m.shared_expert_intermediate_size, Some(48));
    assert!(!m.renormalize);
    let d = compare(name, false);
    assert!(d < Q8_0_BOUND, "max |logit difference| {d}");

    let want = expected_at(&fixture("gguf-moe").join(format!("{name}.q8_0-expected.json")));
    let (got, greedy) = run(&gguf(name), name);
    let e = max_diff(&got, &want.logits);
    eprintln!("{name} Q8_0: max |logit error| {e:e} against float64 on the dequantized values");
    assert!(e < 3e-4, "max |logit error| {e}");
    assert_eq!(greedy, want.greedy);
}

const Q8_0_BOUND: f32 = 6e-2;

/// Copies the GGUF at `src` to `dst`, passing each tensor (name, row-major shape, ggml type,
/// bytes) through `edit`, which may rename, reshape, split or drop it.
fn rewrite(
    src: &Path,
    dst: &Path,
    mut edit: impl FnMut(
        &str,
        Vec<usize>,
        nibble_formats::gguf::GgmlType,
        &[u8],
    ) -> Vec<(String, Vec<usize>, Vec<u8>)>,
) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for k in file.metadata_keys() {
        w.meta(k, file.metadata(k).unwrap().clone());
    }
    for t in file.tensors() {
        for (name, shape, bytes) in edit(&t.name, t.shape(), t.ty, file.tensor_bytes(t)) {
            w.tensor(&name, &shape, t.ty, bytes);
        }
    }
    w.write_to(dst).unwrap();
}

/// Older llama.cpp Mixtral files hold one tensor per expert, `blk.N.ffn_gate.E.weight`.
#[test]
fn mixtral_with_split_experts_equals_the_stacked_file() {
    let tmp = tempfile::tempdir().unwrap();
    let split = tmp.path().join("split.gguf");
    rewrite(
        &gguf("tiny-mixtral"),
        &split,
        |name, shape, _, bytes| match name.strip_suffix("_exps.weight") {
            Some(base) => {
                let n = shape[0];
                let len = bytes.len() / n;
                (0..n)
                    .map(|e| {
                        (
                            format!("{base}.{e}.weight"),
                            shape[1..].to_vec(),
                            bytes[e * len..(e + 1) * len].to_vec(),
                        )
                    })
                    .collect()
            }
            None => vec![(name.to_string(), shape, bytes.to_vec())],
        },
    );
    let (a, _) = run(&gguf("tiny-mixtral"), "tiny-mixtral");
    let (b, _) = run(&split, "tiny-mixtral");
    assert_eq!(max_diff(&a, &b), 0.0);
}

fn load_error(path: &Path) -> String {
    match nibble_model::open_model(path, None) {
        Err(e) => e.to_string(),
        Ok(files) => {
            let backend = nibble_cpu::CpuBackend::new(1).unwrap();
            nibble_model::Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {})
                .err()
                .expect("a broken MoE GGUF must not load")
                .to_string()
        }
    }
}

#[test]
fn an_expert_tensor_of_the_wrong_shape_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.gguf");
    // Three experts' worth of the four in layer 1's up projection.
    rewrite(&gguf("tiny-mixtral"), &bad, |name, mut shape, _, bytes| {
        if name == "blk.1.ffn_up_exps.weight" {
            let keep = bytes.len() / shape[0] * 3;
            shape[0] = 3;
            return vec![(name.to_string(), shape, bytes[..keep].to_vec())];
        }
        vec![(name.to_string(), shape, bytes.to_vec())]
    });
    let e = load_error(&bad);
    assert!(
        e.contains("blk.1.ffn_up_exps.weight") && e.contains("[64, 32, 3]"),
        "{e}"
    );
}

#[test]
fn a_missing_router_or_shared_expert_gate_is_named() {
    for (src, missing) in [
        ("tiny-mixtral", "blk.0.ffn_gate_inp.weight"),
        ("tiny-qwen3-moe", "blk.1.ffn_gate_inp.weight"),
        ("tiny-qwen2-moe", "blk.1.ffn_gate_inp_shexp.weight"),
        ("tiny-qwen2-moe", "blk.0.ffn_down_exps.weight"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let bad = tmp.path().join("bad.gguf");
        rewrite(&gguf(src), &bad, |name, shape, _, bytes| {
            if name == missing {
                vec![]
            } else {
                vec![(name.to_string(), shape, bytes.to_vec())]
            }
        });
        let e = load_error(&bad);
        assert!(e.contains(missing), "{src} without {missing}: {e}");
    }
}

/// A backend without mixture-of-experts layers (the CUDA backend today) refuses a MoE model
/// before a single weight loads: a Mixtral-sized model would otherwise load for minutes first.
#[test]
fn a_backend_without_moe_refuses_before_any_weight_loads() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use nibble_core::{Error, Result};
    use nibble_cpu::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};
    use nibble_formats::HostTensor;
    use nibble_model::{Transformer, open_model};

    struct NoMoe {
        cpu: CpuBackend,
        loaded: AtomicUsize,
    }
    impl Backend for NoMoe {
        type Tensor = CpuTensor;
        type Weight = CpuWeight;
        type Kv = CpuKvCache;

        nibble_cpu::delegate_to_cpu!(cpu);
        nibble_cpu::delegate_attention_and_linear_to_cpu!(cpu);

        fn name(&self) -> String {
            "cpu without moe".into()
        }
        fn load_weight(&self, t: &HostTensor) -> Result<CpuWeight> {
            self.loaded.fetch_add(1, Ordering::Relaxed);
            self.cpu.load_weight(t)
        }
        fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor> {
            self.cpu.embed(table, ids)
        }
        fn check_moe(&self) -> Result<()> {
            Err(Error::unsupported(
                "mixture-of-experts layers here",
                "a test backend",
            ))
        }
    }

    let backend = NoMoe {
        cpu: CpuBackend::new(1).unwrap(),
        loaded: AtomicUsize::new(0),
    };
    for name in ["tiny-mixtral", "tiny-qwen3-moe"] {
        let files = open_model(&fixture(name), None).unwrap();
        let err = Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {})
            .err()
            .expect("a MoE model on a backend without MoE");
        assert!(
            err.to_string().contains("mixture-of-experts"),
            "{name}: {err}"
        );
        assert_eq!(backend.loaded.load(Ordering::Relaxed), 0, "{name}");
    }
    // The same model loads where MoE runs.
    let files = open_model(&fixture("tiny-mixtral"), None).unwrap();
    assert!(Transformer::load(&backend.cpu, files.config, &*files.source, &mut |_, _| {}).is_ok());
}
