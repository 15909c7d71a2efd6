//! The `nibble` binary as a user runs it: errors are one clear line and a non-zero exit, never a
//! panic.

use std::process::Command;

fn nibble(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_clean_failure(args: &[&str], needle: &str) {
    let (ok, _, err) = nibble(args);
    assert!(!ok, "{args:?} should fail");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: stderr lacks {needle:?}: {err}"
    );
}

#[test]
fn missing_model_file() {
    assert_clean_failure(
        &[
            "--model",
            "/nonexistent/m.gguf",
            "generate",
            "--prompt",
            "hi",
        ],
        "/nonexistent/m.gguf",
    );
}

#[test]
fn corrupt_model_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("junk.gguf");
    std::fs::write(&p, b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff").unwrap();
    assert_clean_failure(
        &["--model", p.to_str().unwrap(), "eval", "ppl", "--file", "x"],
        "junk.gguf",
    );
}

#[test]
fn hf_directory_without_config() {
    let tmp = tempfile::tempdir().unwrap();
    assert_clean_failure(
        &[
            "--model",
            tmp.path().to_str().unwrap(),
            "generate",
            "--prompt",
            "hi",
        ],
        "config.json",
    );
}

#[test]
fn bad_sampling_values() {
    assert_clean_failure(
        &["generate", "--prompt", "hi", "--temperature=-1"],
        "temperature",
    );
    assert_clean_failure(&["generate", "--prompt", "hi", "--top-p", "1.5"], "top_p");
}

#[test]
fn generate_streams_on_a_tiny_hf_model() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/tiny-qwen3"
    );
    let (ok, out, err) = nibble(&[
        "--model",
        dir,
        "generate",
        "--prompt",
        "Hi, nibbl",
        "--max-tokens",
        "5",
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("Hi, nibbl"), "{out}");
    assert!(err.contains("5 generated"), "{err}");
}

#[test]
fn chat_reads_turns_from_stdin() {
    use std::io::Write;
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/tiny-qwen3"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["--model", dir, "chat", "--max-tokens", "4"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello\n/reset\nagain\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A prompt per line read; the two messages got replies, /reset and /exit none.
    let turns: Vec<&str> = stdout.split("> ").collect();
    assert_eq!(turns.len(), 5, "{stdout:?}");
    let replied: Vec<bool> = turns[1..].iter().map(|t| !t.is_empty()).collect();
    assert_eq!(replied, vec![true, false, true, false], "{stdout:?}");
}

#[test]
fn bench_throughput_runs_sharegpt_requests_through_the_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("sharegpt.json");
    let convo = |q: &str, a: &str| serde_json::json!({"id": q, "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]});
    let records = serde_json::json!([
        convo(
            "Tell me about the sea and the sky.",
            "The sea is wide and the sky is high."
        ),
        convo("What is a nibble?", "Half a byte, four bits."),
        convo("hi", "x"),
        convo(
            "Name three colors please.",
            "Red, green and blue are colors."
        ),
    ]);
    std::fs::write(&data, records.to_string()).unwrap();
    let json = tmp.path().join("out.json");
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/tiny-qwen3"
    );
    let (ok, out, err) = nibble(&[
        "--model",
        dir,
        "bench",
        "throughput",
        "--dataset",
        data.to_str().unwrap(),
        "--num-prompts",
        "10",
        "--json",
        json.to_str().unwrap(),
        "--max-num-seqs",
        "2",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("throughput at 2 seqs: 3 requests"), "{out}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        r["requests"], 3,
        "the 'hi'/'x' pair is under 4 tokens and dropped"
    );
    assert!(r["output_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn every_kv_format_generates_and_states_its_size() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/tiny-qwen3"
    );
    let mut sizes = Vec::new();
    for kv in [
        "kv16", "kv8", "kv4", "kvfp8", "kv4c", "kv2c", "k8v4", "k4cv2c",
    ] {
        let (ok, out, err) = nibble(&[
            "--model",
            dir,
            "--kv",
            kv,
            "generate",
            "--prompt",
            "Hi, nibbl",
            "--max-tokens",
            "20",
        ]);
        assert!(ok, "{kv}: {err}");
        assert!(out.starts_with("Hi, nibbl"), "{out}");
        let line = err
            .lines()
            .find_map(|l| l.strip_prefix(&format!("nibble: KV cache {kv}, ")))
            .unwrap_or_else(|| panic!("{kv}: no KV line in {err}"));
        let bytes: f64 = line.split(' ').next().unwrap().parse().unwrap();
        sizes.push(bytes);
    }
    // tiny-qwen3: 2 layers x 2 KV heads x head dim 32, keys and values, in 16-token blocks. A mix
    // pays each side's record: k8v4 is kv8's keys (36 bytes a head) and kv4's values (20).
    assert_eq!(
        sizes,
        vec![1024.0, 288.0, 160.0, 272.0, 176.0, 112.0, 224.0, 144.0]
    );
}

#[test]
fn eval_ppl_takes_a_kv_format() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(6),
    )
    .unwrap();
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/tiny-qwen3"
    );
    let ppl = |kv: &str| -> f64 {
        let (ok, out, err) = nibble(&[
            "--model",
            dir,
            "--kv",
            kv,
            "eval",
            "ppl",
            "--file",
            text.to_str().unwrap(),
        ]);
        assert!(ok, "{kv}: {err}");
        out.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let (full, q) = (ppl("kv16"), ppl("kv2c"));
    assert!(full.is_finite() && q.is_finite());
    assert_ne!(full, q, "kv2c must change the arithmetic");
}

#[test]
fn kv_flags_are_checked_before_loading() {
    assert_clean_failure(&["--kv", "kv3", "generate", "--prompt", "hi"], "kv3");
    assert_clean_failure(
        &["--kv", "k8", "generate", "--prompt", "hi"],
        "'k8' names the keys' format but not the values'",
    );
    // The model path is never opened: the block size is refused first.
    assert_clean_failure(
        &[
            "--model",
            "/nonexistent/m.gguf",
            "--kv",
            "kv4c",
            "serve",
            "--block-size",
            "8",
        ],
        "at least 16",
    );
    assert_clean_failure(&["--kv", "kv8", "bench", "serve"], "bench serve only sends");
}

#[test]
fn serve_limits_are_checked_before_loading() {
    let serve = |flag: &str, value: &str, needle: &str| {
        let arg = format!("{flag}={value}");
        assert_clean_failure(&["--model", "/nonexistent/m.gguf", "serve", &arg], needle)
    };
    serve("--header-timeout", "0", "--header-timeout must be");
    serve("--body-timeout", "-1", "--body-timeout must be");
    serve("--body-timeout", "NaN", "--body-timeout must be");
    serve("--max-header-bytes", "100", "--max-header-bytes must be");
    serve(
        "--max-header-bytes",
        "1000000",
        "--max-header-bytes must be",
    );
    serve("--max-body-bytes", "0", "--max-body-bytes");
    serve("--max-messages", "0", "--max-messages");
}

const TINY_LLAMA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../nibble-model/tests/fixtures/tiny-llama3"
);

/// A small ShareGPT file whose conversations are long enough for 256-token sequences of the
/// tiny byte-level tokenizer, alternating calibration (even) and evaluation (odd) positions.
fn long_sharegpt(dir: &std::path::Path) -> std::path::PathBuf {
    let words = [
        "the", "sea", "is", "wide", "and", "sky", "high", "nibble", "half", "byte", "four", "bits",
        "model", "weights", "round", "scale",
    ];
    let records: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            let text = |salt: usize| {
                (0..120)
                    .map(|j| words[(i * 7 + j * 3 + salt) % words.len()])
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            serde_json::json!({"id": i.to_string(), "conversations": [
                {"from": "human", "value": text(1)},
                {"from": "gpt", "value": text(2)}
            ]})
        })
        .collect();
    let path = dir.join("sharegpt.json");
    std::fs::write(&path, serde_json::Value::from(records).to_string()).unwrap();
    path
}

/// `nibble quantize` of `model` to `out` with a small calibration (2 samples of 256 tokens
/// of `data`).
fn quantize_small(
    model: &str,
    format: &str,
    method: &str,
    out: &std::path::Path,
    data: &std::path::Path,
) -> (bool, String, String) {
    nibble(&[
        "--model",
        model,
        "quantize",
        "--format",
        format,
        "--method",
        method,
        "--out",
        out.to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
        "--calib-samples",
        "2",
        "--calib-len",
        "256",
    ])
}

fn read_manifest(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("nibble_quant.json")).unwrap()).unwrap()
}

#[test]
fn quantize_writes_a_checkpoint_with_provenance() {
    let tmp = tempfile::tempdir().unwrap();
    let data = long_sharegpt(tmp.path());
    for (method, format) in [
        ("rtn", "w4a16-g32"),
        ("awq", "w4a16-g32"),
        ("gptq", "w8a16"),
        ("smoothquant", "w8a8-kv8"),
        ("qoq", "w8a8"),
    ] {
        let out = tmp.path().join(format!("ckpt-{method}"));
        let (ok, stdout, err) = quantize_small(TINY_LLAMA, format, method, &out, &data);
        assert!(ok, "{method}: {err}");
        assert!(stdout.contains("peak RSS"), "{stdout}");
        assert!(stdout.contains("14 linear layers quantized"), "{stdout}");
        let manifest = read_manifest(&out);
        assert_eq!(manifest["spec"], format, "{manifest}");
        let p = &manifest["provenance"];
        assert_eq!(p["method"], method, "{p}");
        assert!(p["timings_s"]["quantize"].as_f64().unwrap() >= 0.0, "{p}");
        if method == "rtn" {
            assert!(p["calibration"].is_null(), "{p}");
        } else {
            assert_eq!(p["calibration"]["tokens"], 512, "{p}");
            assert_eq!(
                p["calibration"]["dataset_sha256"].as_str().unwrap().len(),
                64,
                "{p}"
            );
        }
        let q = &manifest["tensors"]["model.layers.1.mlp.down_proj.weight"];
        assert!(q["format"].is_string(), "{q}");
        if method == "qoq" {
            // The rotation is folded into every weight (the head untied): the checkpoint must
            // load and score like the float model through the INT8 kernels, not just be written.
            let text = tmp.path().join("text.txt");
            std::fs::write(
                &text,
                "The quick brown fox jumps over the lazy dog. ".repeat(6),
            )
            .unwrap();
            let ppl = |model: &str| -> f64 {
                let (ok, out, err) = nibble(&[
                    "--model",
                    model,
                    "eval",
                    "ppl",
                    "--file",
                    text.to_str().unwrap(),
                ]);
                assert!(ok, "{model}: {err}");
                out.split_whitespace().nth(1).unwrap().parse().unwrap()
            };
            let (float, quant) = (ppl(TINY_LLAMA), ppl(out.to_str().unwrap()));
            assert_ne!(float, quant, "w8a8 must change the arithmetic");
            assert!(
                (quant / float - 1.0).abs() < 0.02,
                "qoq w8a8 perplexity {quant} against float {float}"
            );
        }
        assert_eq!(
            manifest["tensors"]["model.norm.weight"]["dtype"], "F16",
            "{manifest}"
        );
    }
}

/// `nibble quantize` on mixture-of-experts models: every expert projection is written in the
/// format's codec, the router stays dense, and the checkpoint generates text. Qwen2-MoE's
/// 48-wide shared expert takes per-channel INT4 (no group size divides 48).
#[test]
fn quantize_mixture_of_experts_models() {
    let tmp = tempfile::tempdir().unwrap();
    let data = long_sharegpt(tmp.path());
    let fixtures = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/"
    );
    for (fixture, method, format, router, expert) in [
        (
            "tiny-mixtral",
            "rtn",
            "w4a16-g32",
            "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
        ),
        (
            "tiny-qwen2-moe",
            "gptq",
            "w4a8",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.7.up_proj.weight",
        ),
        (
            "tiny-qwen3-moe",
            "smoothquant",
            "w8a8",
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.experts.0.gate_proj.weight",
        ),
    ] {
        let model = format!("{fixtures}{fixture}");
        let out = tmp.path().join(format!("ckpt-{fixture}"));
        let (ok, stdout, err) = quantize_small(&model, format, method, &out, &data);
        assert!(ok, "{fixture} {method}: {err}");
        assert!(stdout.contains("linear layers quantized"), "{stdout}");
        let manifest = read_manifest(&out);
        let tensors = &manifest["tensors"];
        assert!(
            tensors[expert]["format"].is_string(),
            "{fixture}: {}",
            tensors[expert]
        );
        assert!(
            tensors[router]["format"].is_null(),
            "{fixture}: {}",
            tensors[router]
        );
        assert_eq!(tensors[router]["dtype"], "F16", "{fixture}");
        let (ok, text, err) = nibble(&[
            "--model",
            out.to_str().unwrap(),
            "generate",
            "--prompt",
            "the sea",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ]);
        assert!(ok, "{fixture}: {err}");
        assert!(text.starts_with("the sea"), "{fixture}: {text}");
    }
}

#[test]
fn quantize_refuses_bad_requests_before_working() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let out = out.to_str().unwrap();
    let base = ["--model", TINY_LLAMA, "quantize", "--out", out];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let check = |args: Vec<String>, needle: &str| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_clean_failure(&args, needle);
    };
    check(with(&["--format", "w3a16"]), "unknown weight");
    check(
        with(&["--format", "w4a16", "--method", "magic"]),
        "unknown quantization method",
    );
    check(
        with(&["--format", "w8a8", "--method", "awq"]),
        "does not apply",
    );
    check(with(&["--format", "w4a16-g32", "--dense", "f8"]), "--dense");
    // The tiny model's MLP is 96 wide: group 64 does not divide it.
    check(with(&["--format", "w4a16-g64"]), "96 input channels");
    // An --out under a regular file cannot be created.
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let under = file.join("ckpt");
    assert_clean_failure(
        &[
            "--model",
            TINY_LLAMA,
            "quantize",
            "--format",
            "w8a16",
            "--out",
            under.to_str().unwrap(),
        ],
        "--out",
    );
    // A non-empty --out needs --overwrite.
    let full = tmp.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep"), b"x").unwrap();
    let args = [
        "--model",
        TINY_LLAMA,
        "quantize",
        "--format",
        "w8a16",
        "--out",
        full.to_str().unwrap(),
    ];
    assert_clean_failure(&args, "--overwrite");
    assert!(full.join("keep").exists());
    let mut args = args.to_vec();
    args.push("--overwrite");
    let (ok, _, err) = nibble(&args);
    assert!(ok, "{err}");
    assert!(!full.join("keep").exists() && full.join("nibble_quant.json").exists());
}

#[test]
fn eval_ppl_on_held_out_sharegpt_prints_json() {
    let tmp = tempfile::tempdir().unwrap();
    let data = long_sharegpt(tmp.path());
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "the sea is wide and the sky is high, said the nibble.",
    )
    .unwrap();
    let (ok, out, err) = nibble(&[
        "--model",
        TINY_LLAMA,
        "eval",
        "ppl",
        "--file",
        text.to_str().unwrap(),
        "--sharegpt",
        "3",
        "--ctx",
        "64",
        "--dataset",
        data.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["sharegpt"]["predicted_tokens"], 3 * 63, "{v}");
    assert!(v["sharegpt"]["ppl"].as_f64().unwrap() > 1.0, "{v}");
    assert!(v["file"]["ppl"].as_f64().unwrap() > 1.0, "{v}");
    // Only 4 evaluation conversations exist.
    assert_clean_failure(
        &[
            "--model",
            TINY_LLAMA,
            "eval",
            "ppl",
            "--sharegpt",
            "5",
            "--dataset",
            data.to_str().unwrap(),
        ],
        "Evaluation",
    );
    assert_clean_failure(&["--model", TINY_LLAMA, "eval", "ppl"], "--sharegpt");
}

#[test]
fn quantized_dummy_weights_run_and_bad_precisions_are_refused() {
    let (ok, out, err) = nibble(&[
        "--device",
        "cpu",
        "--dummy-weights",
        "tiny-dummy:w8a8",
        "generate",
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("hi"), "{out}");
    assert_clean_failure(
        &[
            "--device",
            "cpu",
            "--dummy-weights",
            "tiny-dummy:w9a9",
            "generate",
            "--prompt",
            "hi",
        ],
        "unknown weight/activation token",
    );
}

/// `--tensor-parallel-size` splits the model over CPU ranks and writes what one rank writes;
/// a size the heads do not divide, a command it does not run and GPUs where there are none are
/// refused with the reason.
#[test]
fn tensor_parallel_generate_writes_what_one_rank_writes() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../nibble-model/tests/fixtures/tiny-llama3"
    );
    let run = |tp: &str| {
        let (ok, out, err) = nibble(&[
            "--device",
            "cpu",
            "--model",
            dir,
            "--tensor-parallel-size",
            tp,
            "generate",
            "--prompt",
            "Hello",
            "--max-tokens",
            "12",
        ]);
        assert!(ok, "tp {tp}: {err}");
        out
    };
    assert_eq!(run("2"), run("1"));
    assert_clean_failure(
        &[
            "--device",
            "cpu",
            "--model",
            dir,
            "--tensor-parallel-size",
            "3",
            "generate",
            "--prompt",
            "Hello",
        ],
        "num_attention_heads = 4 does not divide into 3",
    );
    assert_clean_failure(
        &[
            "--device",
            "cpu",
            "--model",
            dir,
            "--tensor-parallel-size",
            "2",
            "bench",
            "cpu",
        ],
        "works with generate",
    );
    let on_gpus = |command: &str, needle: &str| {
        let mut args = vec![
            "--device",
            "cuda",
            "--model",
            dir,
            "--tensor-parallel-size",
            "2",
        ];
        args.push(command);
        if command == "generate" {
            args.extend(["--prompt", "Hello"]);
        }
        assert_clean_failure(&args, needle);
    };
    if !nibble_cuda::cuda_available() {
        on_gpus("generate", "NVIDIA driver");
        on_gpus("serve", "NVIDIA driver");
    }
}

#[test]
fn kernels_refuses_an_architecture_that_is_not_one() {
    assert_clean_failure(&["kernels", "--arch", "90"], "expected sm_");
    assert_clean_failure(&["kernels", "--arch", "sm_9x"], "expected sm_");
}

#[test]
fn kernels_fills_the_cache_for_a_named_architecture_without_a_gpu() {
    // NVRTC and the headers come from test.sh's environment (NIBBLE_REQUIRE_NVRTC makes their
    // absence a failure, as for the kernel-compile test).
    if !nibble_cuda::probe::nvrtc_available() || nibble_cuda::probe::cuda_include_dir().is_err() {
        assert!(
            std::env::var_os("NIBBLE_REQUIRE_NVRTC").is_none(),
            "NIBBLE_REQUIRE_NVRTC is set but NVRTC or the CUDA headers are missing"
        );
        eprintln!("skipped: NVRTC is not installed here");
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["kernels", "--arch", "sm_80"])
        .env("NIBBLE_KERNEL_CACHE", cache.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        cache.path().display().to_string()
    );
    // The context's modules and the KV formats' (two dtypes), each a cubin.
    let cubins = std::fs::read_dir(cache.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "cubin"))
        })
        .count();
    assert!(
        cubins > nibble_cuda::compile::SOURCES.len(),
        "{cubins} cubins: {err}"
    );
    assert!(
        err.contains(&format!("{cubins} kernel modules for sm_80")),
        "{err}"
    );
    // --list names those files (all cached now: a second run compiles nothing).
    let listed = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["kernels", "--arch", "sm_80", "--list"])
        .env("NIBBLE_KERNEL_CACHE", cache.path())
        .output()
        .unwrap();
    assert!(listed.status.success());
    let names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(names.len(), cubins);
    assert!(
        names.iter().all(|n| cache.path().join(n).is_file()),
        "{names:?}"
    );
}
