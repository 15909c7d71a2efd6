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
    assert!(out.contains("throughput: 3 requests"), "{out}");
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
    for kv in ["kv16", "kv8", "kv4", "kvfp8", "kv4c", "kv2c"] {
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
    // tiny-qwen3: 2 layers x 2 KV heads x head dim 32, keys and values, in 16-token blocks.
    assert_eq!(sizes, vec![1024.0, 288.0, 160.0, 272.0, 176.0, 112.0]);
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
