#!/usr/bin/env bash
# Set up the llama.cpp peer for benchmarks: a repo-local venv (.venv-peer/)
# with a pinned llama-cpp-python, which compiles llama.cpp from source.
# Idempotent: re-running is a no-op once the pinned version is installed.
#
# Usage: scripts/setup_peer.sh            (FORCE=1 to rebuild)
set -euo pipefail

# Pinned so every machine benchmarks the same llama.cpp revision.
LLAMA_CPP_PYTHON_VERSION=0.3.36

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-peer"

# Build tools. cmake and ninja are NOT needed here: pip pulls them from PyPI
# as build requirements of llama-cpp-python (scikit-build-core). We only need
# a C/C++ compiler and python3's venv module.
need_apt=()
command -v gcc >/dev/null || need_apt+=(gcc)
command -v g++ >/dev/null || need_apt+=(g++)
command -v make >/dev/null || need_apt+=(make)   # harmless; some fallbacks use it
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if ((${#need_apt[@]})); then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends "${need_apt[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# A venv has its own recent pip: the system pip 23.x crashes in its resolver
# on a broken installed dist (TypeError: expected string ... got 'NoneType').
"$VENV/bin/python" -m pip install --quiet --upgrade pip

have="$("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)"
if [ "$have" = "$LLAMA_CPP_PYTHON_VERSION" ] && [ -z "${FORCE:-}" ]; then
    echo "llama-cpp-python $have already installed in $VENV"
    exit 0
fi

# GGML_NATIVE=ON: -march=native, i.e. the best SIMD this CPU has, which is what
# nibble gets too. --no-binary/--no-cache-dir: always compile here, never reuse
# a wheel built for another CPU. Takes ~5-15 min on 2 cores.
echo "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (compiles llama.cpp) ..."
start=$(date +%s)
CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/python" -m pip install \
    --no-cache-dir --no-binary llama-cpp-python ${FORCE:+--force-reinstall} \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
echo "done in $(( $(date +%s) - start ))s: $("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')"
