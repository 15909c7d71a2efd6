//! Tensor parallelism on two GPUs (NCCL): the all-reduce is the exact sum; the fixtures' shards
//! over two GPUs give one GPU's logits within the bf16 bound, the same bits on both ranks, and
//! the same greedy path up to a near-tie, with decode steps (and their all-reduces) replayed
//! from CUDA graphs; quantized weights cut on whole groups run the same; a rank that fails ends
//! the run with its error instead of hanging the other.
//!
//! Needs two GPUs: `cargo test -p nibble-cuda --features gpu-tests --test gpu_tp`
//! (scripts/gpu-tp-run.sh runs the prebuilt binary on a two-GPU machine).

use std::time::{Duration, Instant};

use nibble_cuda::tensor_parallel::{GpuGroup, run_sharded};
use nibble_cuda::{CudaBackend, Dtype};
use nibble_engine::{Engine, GenerateRequest, SamplingParams};
use nibble_model::{Backend, ModelFiles, Transformer, open_model};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "gpu/common.rs"]
mod common;

use common::{fixture, greedy, top2};

const TIE: f32 = 0.05;

fn group() -> GpuGroup {
    GpuGroup::new(&[0, 1], Dtype::Bf16).expect("two CUDA GPUs")
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// What one run (one GPU, or each rank of two) gives along a fixed token path: the logits of
/// every step (teacher-forced), free-running greedy tokens, and (replays, captures) of graphs.
#[derive(Debug, PartialEq)]
struct Run {
    logits: Vec<Vec<f32>>,
    free: Vec<u32>,
    graphs: (u64, u64),
    /// Outputs of several rows summed peer to peer (`CudaBackend::peer_rows_summed`).
    rows_summed: usize,
}

/// Greedy tokens each run generates freely after the prompt.
const STEPS: usize = 40;

fn run_on(e: Engine<CudaBackend>, path: &[u32], prompt_len: usize) -> Run {
    let logits = e.model.step_logits(&e.backend, path, prompt_len).unwrap();
    let free = greedy(&e, &path[..prompt_len], STEPS);
    Run {
        logits,
        free,
        graphs: e.backend.graph_counts(),
        rows_summed: e.backend.peer_rows_summed(),
    }
}

/// One GPU, then two ranks (with the output head split by vocabulary, or whole), over the model
/// `files`, along `path` (its first `prompt_len` tokens the prompt): each rank's [`Run`].
fn one_and_two(
    name: &str,
    split_head: bool,
    window: bool,
    files: &ModelFiles,
    path: &[u32],
    prompt_len: usize,
) -> (Run, Vec<Run>) {
    one_and_two_with(name, split_head, window, true, files, path, prompt_len)
}

/// [`one_and_two`], the peer sum on or off (`GpuGroup::peer_sum`).
fn one_and_two_with(
    name: &str,
    split_head: bool,
    window: bool,
    peer: bool,
    files: &ModelFiles,
    path: &[u32],
    prompt_len: usize,
) -> (Run, Vec<Run>) {
    let engine = |backend, model| Engine {
        backend,
        model,
        tokenizer: files.tokenizer.clone(),
    };
    let be = CudaBackend::new(0, Dtype::Bf16).unwrap();
    let model = Transformer::load(&be, files.config.clone(), &*files.source, &mut |_, _| {});
    let one = run_on(engine(be, model.unwrap()), path, prompt_len);
    let g = group()
        .split_head(split_head)
        .symmetric_window(window)
        .peer_sum(peer);
    let two = run_sharded(&g, &*files.source, &files.config, |_, backend, model| {
        assert_eq!(backend.gathers_columns(), split_head);
        assert_eq!(
            backend.sums_with_peer(),
            peer,
            "{name}: the peer sum (GPUs not peers?)"
        );
        Ok(run_on(engine(backend, model), path, prompt_len))
    })
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    (one, two)
}

/// Two ranks agree bit for bit, stay within `bound` of one GPU's logits, pick its token wherever
/// that is no near-tie, and follow its free-running path up to the first near-tie. Decode steps
/// replay from CUDA graphs (holding the all-reduces), but for mixture-of-experts models, whose
/// routing reads logits on the host (no graphs at all).
fn check_two_follow_one(name: &str, one: &Run, two: &[Run], bound: f64, tie: f32) {
    assert_eq!(two[0], two[1], "{name}: the ranks disagree");
    let mut first_tie = one.free.len();
    for (step, (w, g)) in one.logits.iter().zip(&two[0].logits).enumerate() {
        let e = rel_err(g, w);
        assert!(
            e < bound,
            "{name} step {step}: relative error {e:.2e} over {bound:.0e}"
        );
        let (tok, gap) = top2(w);
        if gap > tie {
            assert_eq!(top2(g).0, tok, "{name} step {step}: gap {gap}");
        } else {
            first_tie = first_tie.min(step);
        }
    }
    let same = two[0]
        .free
        .iter()
        .zip(&one.free)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        same >= first_tie.min(one.free.len()),
        "{name}: two GPUs left one GPU's greedy path at {same}, first near-tie at {first_tie}"
    );
    let (replays, captures) = two[0].graphs;
    let moe = name.contains("mixtral") || name.contains("moe");
    assert!(
        if moe {
            (replays, captures) == (0, 0)
        } else {
            captures >= 1 && replays as usize >= one.free.len() - 8
        },
        "{name}: {replays} replays of {captures} graphs on the ranks"
    );
    eprintln!(
        "{name}: 2 GPUs = 1 GPU for {same} free-running tokens (first near-tie {first_tie}), \
         {replays} graph replays a rank"
    );
}

/// NCCL's sum of two ranks' f32 vectors is the host's sum, bit for bit, on both ranks (two
/// addends: one rounding, whatever the order), for odd sizes and repeated calls.
#[test]
fn nccl_all_reduce_is_the_exact_sum() {
    let seed = Instant::now().elapsed().as_nanos() as u64 ^ 0x5eed;
    eprintln!("nccl_all_reduce_is_the_exact_sum: seed {seed}");
    let g = group().symmetric_window(true);
    eprintln!("{}", nibble_cuda::nccl::describe().unwrap());
    // Past 4,099 elements: sizes the peer sum of several rows takes (multiples of 4; past a
    // receive slot, `peer_sum::SLOT_FLOATS`, in bf16 only, in two pieces) and one it leaves to
    // NCCL.
    let slot = nibble_cuda::peer_sum::SLOT_FLOATS;
    let sizes = [
        1usize,
        7,
        4099,
        3 * 4096,
        1 << 20,
        1 << 20 | 3,
        slot + 3 * 4096,
    ];
    let peer_sizes = |bf16: bool| {
        sizes
            .iter()
            .filter(|&&n| n % 4 == 0 && (bf16 || n <= slot))
            .count()
    };
    let parts: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|rank| {
            let mut r = ChaCha8Rng::seed_from_u64(seed + rank);
            sizes
                .iter()
                .map(|&n| (0..n).map(|_| r.random_range(-1e3f32..1e3)).collect())
                .collect()
        })
        .collect();
    type Sums = Vec<Vec<f32>>;
    let got: Vec<(Sums, Sums, Sums, usize, bool)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (g, parts) = (&g, &parts);
                s.spawn(move || {
                    let mut be = g.rank_backend(rank).unwrap();
                    // The latency of decode-sized all-reduces (a Llama-3-8B row of f32, up to 256
                    // rows), in activations (NCCL's default kernels), in the symmetric window
                    // (its symmetric kernels) and as the peer sum of several rows where the
                    // GPUs are peers, for the benchmark notes; not a pass or fail.
                    if rank == 0 {
                        eprintln!(
                            "symmetric window: {}, peer sum: {}",
                            be.window_tensor(1, 1).is_some(),
                            be.sums_with_peer()
                        );
                    }
                    for rows in [1usize, 16, 64, 256] {
                        let plain = be.load_vector(&vec![1.0f32; rows * 4096]).unwrap();
                        let window = be.window_tensor(rows, 4096);
                        let peer = || {
                            be.sums_with_peer()
                                .then(|| be.load_vector(&vec![1.0f32; rows * 4096]).unwrap())
                        };
                        let (peer, peer16) = (peer(), peer());
                        for (name, t, peer_rows, bf16) in [
                            ("activations", Some(plain), false, false),
                            ("window", window, false, false),
                            ("the peer sum", peer, true, false),
                            ("the peer sum in bf16", peer16, true, true),
                        ] {
                            let Some(mut t) = t else { continue };
                            be.peer_rows = peer_rows;
                            be.peer_rows_bf16 = bf16;
                            for round in 0..2 {
                                be.synchronize().unwrap();
                                let start = Instant::now();
                                for _ in 0..1000 {
                                    be.all_reduce(&mut t).unwrap();
                                }
                                be.synchronize().unwrap();
                                if round == 1 && rank == 0 {
                                    eprintln!(
                                        "all-reduce of {rows}x4096 f32 in {name}, eager: \
                                         {:.1} us each",
                                        start.elapsed().as_secs_f64() * 1e3
                                    );
                                }
                            }
                        }
                    }
                    // The window's sums are exact too.
                    be.peer_rows = false;
                    if let Some(mut t) = be.window_tensor(1, 4099) {
                        be.gpu.upload(t.ptr, &parts[rank][2]).unwrap();
                        be.all_reduce(&mut t).unwrap();
                        let got = be.to_host(&t).unwrap();
                        let want: Vec<f32> = parts[0][2]
                            .iter()
                            .zip(&parts[1][2])
                            .map(|(a, b)| a + b)
                            .collect();
                        assert_eq!(got, want, "rank {rank}: the window's sum of 4099 elements");
                    }
                    // NCCL's sums, then the peer sum's (twice over: every receive slot reused,
                    // holding the previous round's addends).
                    let sum_all = |be: &CudaBackend| -> Sums {
                        parts[rank]
                            .iter()
                            .map(|p| {
                                let mut t = be.load_vector(p).unwrap();
                                be.all_reduce(&mut t).unwrap();
                                be.to_host(&t).unwrap()
                            })
                            .collect()
                    };
                    be.peer_rows_bf16 = false;
                    let nccl = sum_all(&be);
                    be.peer_rows = true;
                    let before = be.peer_rows_summed();
                    let _ = sum_all(&be);
                    let peer = sum_all(&be);
                    be.peer_rows_bf16 = true;
                    let peer16 = sum_all(&be);
                    let summed = be.peer_rows_summed() - before;
                    (nccl, peer, peer16, summed, be.sums_with_peer())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    for (rank, (nccl, peer, peer16, summed, with_peer)) in got.iter().enumerate() {
        for (i, n) in sizes.iter().enumerate() {
            let want: Vec<f32> = parts[0][i]
                .iter()
                .zip(&parts[1][i])
                .map(|(a, b)| a + b)
                .collect();
            // In bf16 where the peer sum takes the size: both addends rounded, then added in f32
            // (NCCL's f32 sum where there is no peer sum).
            let want16: Vec<f32> = parts[0][i]
                .iter()
                .zip(&parts[1][i])
                .map(|(&a, &b)| {
                    if *with_peer && n % 4 == 0 {
                        bf(a) + bf(b)
                    } else {
                        a + b
                    }
                })
                .collect();
            for (what, got, want) in [
                ("peer sum in bf16", &peer16[i], &want16),
                ("NCCL", &nccl[i], &want),
                ("peer sum", &peer[i], &want),
            ] {
                assert!(
                    got.len() == want.len()
                        && got
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "rank {rank}, {what}, {n} elements"
                );
            }
        }
        // Without the peer sum (GPUs that are not peers, or not Hopper) NCCL sums everything.
        let want_summed = if *with_peer {
            2 * peer_sizes(false) + peer_sizes(true)
        } else {
            0
        };
        assert_eq!(
            *summed, want_summed,
            "rank {rank}: peer sums of several rows"
        );
    }
}

/// The gate every graph launch of a rank goes through (`Communicator::while_live`, from
/// `CudaContext::run_forward`): it runs the launch while the group is live, and once the group is
/// aborted refuses it without running it, as it refuses a forward pass; so a replay that passed
/// `begin_forward`'s check just before an abort cannot queue collectives on a freed communicator.
#[test]
fn an_aborted_group_refuses_graph_launches() {
    let g = group();
    let aborted = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (g, aborted) = (&g, &aborted);
            s.spawn(move || {
                let be = g.rank_backend(rank).unwrap();
                let comm = be
                    .communicator()
                    .expect("a rank has a communicator")
                    .clone();
                let mut ran = false;
                comm.while_live(&mut || {
                    ran = true;
                    Ok(())
                })
                .unwrap();
                assert!(ran, "rank {rank}: a live group runs the launch");
                aborted.wait();
                if rank == 0 {
                    g.abort("test: the group is aborted between a check and a replay");
                }
                aborted.wait();
                let mut ran = false;
                let refused = comm
                    .while_live(&mut || {
                        ran = true;
                        Ok(())
                    })
                    .expect_err("an aborted group refuses the launch");
                assert!(!ran, "rank {rank}: the refused launch ran");
                assert!(refused.to_string().contains("abandoned"), "{refused}");
                let step = be.begin_forward(&[1], &nibble_model::BatchLayout::default());
                assert!(step.is_err(), "rank {rank}: a forward pass after the abort");
            });
        }
    });
}

/// The architecture fixtures (GQA, QKV biases, QK norms, Gemma 3's windows and post-norms) over
/// two GPUs against one, the untied ones also with the output head split by vocabulary.
#[test]
fn two_gpus_follow_one_on_the_fixtures() {
    for name in [
        "tiny-llama3",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-mistral",
    ] {
        let files = open_model(&fixture(name), None).unwrap();
        let prompt: Vec<u32> = "The quick brown fox".bytes().map(u32::from).collect();
        let path: Vec<u32> = prompt
            .iter()
            .copied()
            .chain((0..STEPS as u32).map(|i| 3 + (i * 37) % 200))
            .collect();
        let (one, two) = one_and_two(name, false, true, &files, &path, prompt.len());
        check_two_follow_one(name, &one, &two, 2e-2, TIE);
        // Row-parallel outputs summed in place by NCCL's default kernels, as where NCCL has no
        // symmetric memory and for prefill chunks longer than the window.
        if name == "tiny-llama3" {
            let (one, two) = one_and_two(name, false, false, &files, &path, prompt.len());
            check_two_follow_one(&format!("{name} (no window)"), &one, &two, 2e-2, TIE);
        }
        // The untied heads split by vocabulary: each rank computes half of the logits, NCCL
        // gathers them, strided copies lay them side by side.
        if !files.source.contains("lm_head.weight") {
            continue;
        }
        let (one, two) = one_and_two(name, true, true, &files, &path, prompt.len());
        check_two_follow_one(&format!("{name} (split head)"), &one, &two, 2e-2, TIE);
    }
}

/// A two-layer Llama wide enough for the peer sum's gemvs (Llama-3-8B's widths): o_proj and
/// down_proj halves push their rows to the other rank, the next block's normed gemvs (gate/up,
/// layer 1's q/k/v) wait for them and sum them, the last down_proj's sum is settled on its own.
fn wide_two_layer_llama() -> (tempfile::TempDir, ModelFiles) {
    let dir = tempfile::tempdir().unwrap();
    let config = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "head_dim": 128,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 2048}"#;
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    let files = nibble_model::dummy::open_dummy(dir.path().to_str().unwrap(), 3).unwrap();
    (dir, files)
}

/// The peer sum on two GPUs that see each other's memory (docs/tensor-parallel.md): the ranks
/// agree bit for bit (logits and free-running tokens) and follow one GPU's logits as closely as
/// NCCL's all-reduce does, decode steps replayed from graphs; against NCCL's sums (whose o_proj
/// halves run on cuBLAS, another order of the same products) they stay within the bf16 bound.
#[test]
fn the_peer_sum_follows_one_gpu() {
    let (_dir, files) = wide_two_layer_llama();
    let path: Vec<u32> = (0..48).map(|i| 1 + (i * 53) % 2000).collect();
    let name = "wide two-layer llama";
    let (one, nccl) = one_and_two_with(name, false, true, false, &files, &path, 8);
    let (_, two) = one_and_two_with(name, false, true, true, &files, &path, 8);
    // Random weights leave near-ties all along a free-running path, so the paths are not
    // compared with one GPU's here (the fixtures' tests do); the teacher-forced logits are.
    let worst = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| rel_err(x, y))
            .fold(0.0, f64::max)
    };
    // The prompt's and the teacher-forced steps' sums of several rows are the peer's too.
    assert!(two[0].rows_summed > 0, "no peer sum of several rows");
    assert_eq!(nccl[0].rows_summed, 0);
    for (what, runs) in [("peer sum", &two), ("NCCL", &nccl)] {
        assert_eq!(runs[0], runs[1], "{what}: the ranks disagree");
        let (replays, captures) = runs[0].graphs;
        assert!(
            captures >= 1 && replays >= 30,
            "{what}: {replays} replays of {captures} graphs"
        );
        let e = worst(&runs[0].logits, &one.logits);
        eprintln!("{name} ({what}): logits within {e:.2e} of one GPU");
        assert!(e < 2e-2, "{what}: {e:.2e} from one GPU");
    }
    let e = worst(&two[0].logits, &nccl[0].logits);
    eprintln!("{name}: the peer sum's logits within {e:.2e} of NCCL's sums");
    assert!(e < 2e-2, "peer sum against NCCL: {e:.2e}");
}

/// The peer sum's arithmetic, op by op on two GPUs: a row-parallel layer's sum is the host's
/// sum of the two ranks' gemv outputs bit for bit, summed at once or left to the next normed
/// gemv (whose output and residual are then those of the same gemv given the host's sum), or to
/// a plain pre-norm; for odd widths, NaN-poisoned activations, and enough rounds that every
/// receive slot is reused.
#[test]
fn peer_sum_is_the_exact_sum() {
    use nibble_formats::gguf::GgmlType;
    use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
    let seed = Instant::now().elapsed().as_nanos() as u64 ^ 0x9ee5;
    eprintln!("peer_sum_is_the_exact_sum: seed {seed}");
    let weight = |name: &str, v: &[f32], rows: usize, cols: usize| HostTensor {
        name: name.into(),
        shape: vec![rows, cols],
        format: WeightFormat::Ggml(GgmlType::BF16),
        bytes: TensorBytes::Owned(std::sync::Arc::new(
            v.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        )),
    };
    // (n, k) of the row-parallel layer; the normed consumer reads n channels.
    let shapes = [(4096usize, 2048usize), (1280, 7168), (4096, 256)];
    let g = group();
    let halves = std::sync::Mutex::new(vec![Vec::new(); 2]);
    let met = std::sync::Barrier::new(2);
    type Out = Vec<(String, Vec<f32>, Vec<f32>)>;
    let outs: Vec<Out> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2usize)
            .map(|rank| {
                let (g, halves, met) = (&g, &halves, &met);
                s.spawn(move || -> Out {
                    let be = g.rank_backend(rank).unwrap();
                    assert!(be.sums_with_peer(), "the two GPUs are not peers");
                    let mut out = Vec::new();
                    let mut r = ChaCha8Rng::seed_from_u64(seed + rank as u64);
                    let mut shared = ChaCha8Rng::seed_from_u64(seed ^ 0xabc);
                    for round in 0..6 {
                        let (n, k) = shapes[round % shapes.len()];
                        // Recycles the arena: every activation below is made after it.
                        be.poison_activations(64 << 20).unwrap();
                        let rand = |r: &mut ChaCha8Rng, len: usize, scale: f32| -> Vec<f32> {
                            (0..len).map(|_| r.random_range(-scale..scale)).collect()
                        };
                        let w = be
                            .load_weight(&weight("w", &rand(&mut r, n * k, 0.05), n, k))
                            .unwrap();
                        let x32 = be.tensor_from_f32(&rand(&mut r, k, 1.0), 1, k).unwrap();
                        let x = be.as_half(&x32).unwrap();
                        // What both ranks share: the residual, the norm, the consumer's weight
                        // (20 MB or more, so the normed gemv takes it).
                        let n2 = (20 << 20) / (2 * n) + 7;
                        let res = rand(&mut shared, n, 1.0);
                        let nw: Vec<f32> =
                            rand(&mut shared, n, 0.5).iter().map(|v| 1.0 + v).collect();
                        let w2 = be
                            .load_weight(&weight("w2", &rand(&mut shared, n2 * n, 0.02), n2, n))
                            .unwrap();
                        let gn = be.load_vector(&nw).unwrap();
                        // This rank's half alone, then the host's sum of the two.
                        let half = be.tensor_from_f32(&vec![f32::NAN; n], 1, n).unwrap();
                        nibble_cuda::dense_gemv::run(&be, &x, &w, &half).unwrap();
                        halves.lock().unwrap()[rank] = be.to_host(&half).unwrap();
                        met.wait();
                        let want: Vec<f32> = {
                            let h = halves.lock().unwrap();
                            h[0].iter().zip(&h[1]).map(|(a, b)| a + b).collect()
                        };
                        met.wait();
                        // Summed at once.
                        let now = be.linear_summed(&x, &w).unwrap();
                        out.push((
                            format!("round {round} {n}x{k} summed"),
                            be.to_host(&now).unwrap(),
                            want.clone(),
                        ));
                        // Left to the normed gemv, against the same gemv given the host's sum.
                        let d = be.linear_summed_delta(&x, &w).unwrap();
                        let mut xr = be.tensor_from_f32(&res, 1, n).unwrap();
                        let fused = be.peer_sum_counts().0;
                        let y = be
                            .norm_linear(&mut xr, Some(&d), &gn, 1e-5, &w2, None)
                            .unwrap();
                        // Which path took the sum (both give the same bits): counted, not
                        // asserted here, where a panic would leave the peer waiting.
                        let took = (be.peer_sum_counts().0 - fused) as f32;
                        out.push((
                            format!("round {round} normed gemv took the sum"),
                            vec![took],
                            vec![1.0],
                        ));
                        let wd = be.tensor_from_f32(&want, 1, n).unwrap();
                        let mut xr2 = be.tensor_from_f32(&res, 1, n).unwrap();
                        let y2 = be
                            .norm_linear(&mut xr2, Some(&wd), &gn, 1e-5, &w2, None)
                            .unwrap();
                        out.push((
                            format!("round {round} {n}x{k} normed gemv"),
                            be.to_host(&y).unwrap(),
                            be.to_host(&y2).unwrap(),
                        ));
                        out.push((
                            format!("round {round} {n}x{k} residual"),
                            be.to_host(&xr).unwrap(),
                            be.to_host(&xr2).unwrap(),
                        ));
                        // Left to a plain pre-norm (the sum settled first).
                        let d = be.linear_summed_delta(&x, &w).unwrap();
                        let mut xr3 = be.tensor_from_f32(&res, 1, n).unwrap();
                        let settled = be.peer_sum_counts().1;
                        let h3 = be.pre_norm(&mut xr3, Some(&d), &gn, 1e-5);
                        let took = (be.peer_sum_counts().1 - settled) as f32;
                        out.push((
                            format!("round {round} pre-norm settled the sum"),
                            vec![took],
                            vec![1.0],
                        ));
                        let mut xr4 = be.tensor_from_f32(&res, 1, n).unwrap();
                        let h4 = be.pre_norm(&mut xr4, Some(&wd), &gn, 1e-5);
                        out.push((
                            format!("round {round} {n}x{k} pre-norm"),
                            be.to_host(&h3).unwrap(),
                            be.to_host(&h4).unwrap(),
                        ));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut failed = Vec::new();
    for (rank, o) in outs.iter().enumerate() {
        for (what, got, want) in o {
            assert_eq!(got.len(), want.len(), "rank {rank} {what}");
            let bad: Vec<usize> = (0..got.len())
                .filter(|&i| got[i].to_bits() != want[i].to_bits())
                .collect();
            if let Some(&i) = bad.first() {
                failed.push(format!(
                    "rank {rank} {what}: {} of {} differ, first at {i}: {} against {}",
                    bad.len(),
                    got.len(),
                    got[i],
                    want[i]
                ));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Mixture-of-experts fixtures over two GPUs: every expert's width split, the router whole (so
/// both ranks route alike), the grouped expert launches on half-width experts. A token whose
/// top experts are a near-tie may route apart from one GPU's choice; these fixtures' logits stay
/// within the bound on the CPU's TP check, and the same is asked here.
#[test]
fn moe_fixtures_split_over_two_gpus() {
    for name in ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"] {
        let files = open_model(&fixture(name), None).unwrap();
        let path: Vec<u32> = (0..48).map(|i| 3 + (i * 37) % 200).collect();
        let (one, two) = one_and_two(name, false, true, &files, &path, 8);
        check_two_follow_one(name, &one, &two, 2e-2, TIE);
    }
}

/// Quantized weights split on whole groups (W4A16 g32: o_proj's 128 and down_proj's 352 input
/// columns a rank) and per-channel INT8 with per-token INT8 activations (each rank quantizes its
/// own slice of the activations with its own scale, so W8A8 is close to one GPU, not equal:
/// measured 5.5e-2 relative at worst over 48 steps, bound 1e-1; its near-ties are wider, 0.3
/// here, and the first one ends the shared greedy path).
#[test]
fn quantized_weights_split_on_their_groups() {
    for (spec, bound, tie) in [
        ("tiny-dummy:w4a16-g32", 2e-2, TIE),
        ("tiny-dummy:w8a8", 1e-1, 0.3),
    ] {
        let files = nibble_model::dummy::open_dummy(spec, 3).unwrap();
        let path: Vec<u32> = (0..48).map(|i| 1 + (i * 53) % 500).collect();
        let (one, two) = one_and_two(spec, false, true, &files, &path, 8);
        check_two_follow_one(spec, &one, &two, bound, tie);
    }
    // A group size that would cut a group is refused by name, before anything loads.
    let files = nibble_model::dummy::open_dummy("tiny-dummy:w4a16-g64", 3).unwrap();
    let e = run_sharded(&group(), &*files.source, &files.config, |_, _, _| Ok(()))
        .expect_err("352 columns are not whole groups of 64")
        .to_string();
    assert!(e.contains("down_proj") && e.contains("group of 64"), "{e}");
}

/// Says when a rank's body ended: dropped at its end, after its engine.
struct Report(usize, Instant);
impl Drop for Report {
    fn drop(&mut self) {
        eprintln!("rank {} body ends at {:?}", self.0, self.1.elapsed());
    }
}

/// Runs the tiny Llama 3 fixture on `g`, rank 1 failing after a few tokens while rank 0 goes on
/// into the next all-reduce; returns the run's error and how long after rank 1's failure the
/// run ended. With `hang`, rank 1 stops taking part instead (sleeps) without failing.
fn fail_rank_one(g: &GpuGroup, hang: bool) -> (String, Duration) {
    let files = open_model(&fixture("tiny-llama3"), None).unwrap();
    fail_rank_one_of(g, &files, hang, false)
}

/// [`fail_rank_one`] on the model `files`; with `peer`, rank 0 must have waited in peer sums
/// (the group sums with the peer, and rank 0's normed gemvs finished some before the failure).
fn fail_rank_one_of(
    g: &GpuGroup,
    files: &ModelFiles,
    hang: bool,
    peer: bool,
) -> (String, Duration) {
    let t0 = Instant::now();
    let failed_at = std::sync::Mutex::new(None);
    let e = run_sharded(g, &*files.source, &files.config, |rank, backend, model| {
        // When each rank's body ends (returned or unwound, its engine dropped), for the log:
        // where a slow end spends its time.
        let _report = Report(rank, t0);
        let e = Engine {
            backend,
            model,
            tokenizer: files.tokenizer.clone(),
        };
        let prompt: Vec<u32> = (1..20).collect();
        if rank == 1 {
            greedy(&e, &prompt, 5);
            eprintln!("rank 1 fails at {:.3}s", t0.elapsed().as_secs_f64());
            *failed_at.lock().unwrap() = Some(Instant::now());
            if hang {
                std::thread::sleep(Duration::from_secs(600));
            }
            return Err(nibble_core::Error::InvalidArgument(
                "injected failure on rank 1".into(),
            ));
        }
        // Checked as errors, not asserts: a rank that panics here would leave its peer waiting.
        if peer && !e.backend.sums_with_peer() {
            return Err(nibble_core::Error::InvalidArgument(
                "not summing peer to peer".into(),
            ));
        }
        for round in 0..1000 {
            if round == 1 && peer && e.backend.peer_sum_counts().0 == 0 {
                return Err(nibble_core::Error::InvalidArgument(
                    "no normed gemv waited for a peer".into(),
                ));
            }
            let req = GenerateRequest {
                prompt_ids: prompt.clone(),
                params: SamplingParams::default(),
                max_tokens: 200,
                stop: vec![],
                ignore_eos: true,
                constraint: None,
            };
            e.generate(&req, &mut |_| {})?;
        }
        Ok(())
    })
    .expect_err("the run fails")
    .to_string();
    let after = failed_at.lock().unwrap().expect("rank 1 failed").elapsed();
    eprintln!(
        "run_sharded returned at {:?}, {after:?} after the failure",
        t0.elapsed()
    );
    (e, after)
}

/// A rank that fails mid-generation ends the run with its own error within seconds: rank 0's
/// collective (NCCL's default kernels) is aborted, not left waiting.
#[test]
fn a_failed_rank_ends_the_run_with_its_error() {
    let (e, after) = fail_rank_one(&group().symmetric_window(false), false);
    assert!(e.contains("injected failure on rank 1"), "{e}");
    assert!(after < Duration::from_secs(60), "took {after:?}");
    eprintln!("failed rank: the run ended {after:?} after the failure, with: {e}");
}

/// A rank that fails while the other waits for its half of a peer sum (the wide model's normed
/// gemvs) ends the run with its error within seconds: the group's abort raises the flag the
/// waiting kernel polls, and nothing is left blocked (no watchdog, no process exit).
#[test]
fn a_failed_rank_ends_a_peer_sum_wait() {
    let (_dir, files) = wide_two_layer_llama();
    let g = group().symmetric_window(false).peer_sum(true);
    let (e, after) = fail_rank_one_of(&g, &files, false, true);
    assert!(e.contains("injected failure on rank 1"), "{e}");
    assert!(after < Duration::from_secs(60), "took {after:?}");
    eprintln!("failed rank during peer sums: the run ended {after:?} after the failure, with: {e}");
}

/// The child of [`a_failed_rank_with_the_window_ends_the_process`]: run only by it.
#[test]
#[ignore = "run by a_failed_rank_with_the_window_ends_the_process in a child process"]
fn failed_rank_child_with_the_window() {
    // Without the peer sum, whose sums of any size would take the window's place.
    let (e, _) = fail_rank_one(
        &group()
            .symmetric_window(true)
            .peer_sum(false)
            .exit_if_stuck(Duration::from_secs(10)),
        false,
    );
    // The run returned instead of the watchdog's exit: the process still ends with the failure.
    panic!("the run ended with: {e}");
}

/// The child of [`a_hung_rank_ends_the_process_at_the_step_deadline`]: run only by it.
#[test]
#[ignore = "run by a_hung_rank_ends_the_process_at_the_step_deadline in a child process"]
fn hung_rank_child() {
    fail_rank_one(
        &group()
            .step_deadline(Some(Duration::from_secs(3)))
            .exit_if_stuck(Duration::from_secs(5)),
        true,
    );
}

/// Runs the ignored test `name` of this binary in a child process; returns its exit status, its
/// stderr, and how long after its rank 1 failed (or hung) it ended.
fn run_child(name: &str) -> (std::process::ExitStatus, String, f64) {
    let t0 = Instant::now();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture"])
        .output()
        .unwrap();
    let took = t0.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "{name} ended in {took:.1}s with {:?}; its stderr:\n{err}",
        out.status
    );
    let failed: f64 = err
        .lines()
        .find_map(|l| l.strip_prefix("rank 1 fails at "))
        .and_then(|t| t.trim().trim_end_matches('s').parse().ok())
        .expect("rank 1's failure time in the child's stderr");
    (out.status, err, took - failed)
}

/// A rank that hangs (stops taking part without failing): its peer waits for its GPU in the
/// next collective; past the step deadline (3 s here, 300 s by default) the group aborts, and
/// with the hung rank never returning, the watchdog ends the process with the reason.
#[test]
fn a_hung_rank_ends_the_process_at_the_step_deadline() {
    let (status, err, after) = run_child("hung_rank_child");
    assert!(!status.success(), "the child succeeded");
    assert!(
        err.contains("past the 3s step deadline"),
        "no deadline in the child's stderr"
    );
    assert!(
        err.contains("exiting"),
        "the watchdog did not end the child"
    );
    assert!(after < 60.0, "the child ended {after:.0}s after the hang");
}

/// With NCCL's symmetric memory, whose kernels do not stop at an abort, a rank left waiting for
/// its failed peer cannot return; the group's watchdog (`GpuGroup::exit_if_stuck`, as the CLI
/// sets it) ends the process with the failure instead of a hang. Run in a child process.
#[test]
fn a_failed_rank_with_the_window_ends_the_process() {
    let (status, err, after) = run_child("failed_rank_child_with_the_window");
    assert!(!status.success(), "the child succeeded");
    assert!(
        err.contains("injected failure on rank 1"),
        "the failure is not in the child's stderr"
    );
    // The run returned (NCCL aborted everything), or the watchdog exited 10 s later.
    assert!(
        after < 60.0,
        "the child ended {after:.0}s after the failure"
    );
}
