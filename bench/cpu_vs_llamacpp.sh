#!/usr/bin/env bash
# nibble vs llama.cpp on the CPU, same GGUF file, same thread count, one run, interleaved so both
# see the same machine load. Writes bench/results/cpu-<date>.json and prints a summary.
# Needs: scripts/setup_peer.sh once (builds llama.cpp through llama-cpp-python).
# Usage: bench/cpu_vs_llamacpp.sh [MODEL.gguf] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q -p nibble-cli
MODEL="${1:-$(target/release/nibble fetch)}"
THREADS="${2:-2}"
[ -x .venv-peer/bin/python ] || scripts/setup_peer.sh
OUT=bench/results; mkdir -p "$OUT"; TAG="cpu-$(date -u +%Y%m%d-%H%M)"
for round in 1 2; do
  target/release/nibble --model "$MODEL" --threads "$THREADS" bench --prompt-tokens 128 --gen-tokens 64 \
    --repeats 3 --json "$OUT/$TAG-nibble-$round.json"
  .venv-peer/bin/python bench/peer_llamacpp.py "$MODEL" --threads "$THREADS" --prompt-tokens 128 \
    --gen-tokens 64 --repeats 3 --json "$OUT/$TAG-llamacpp-$round.json" >/dev/null
done
python3 - "$OUT" "$TAG" <<'PY'
import json, sys, glob, subprocess, platform
out, tag = sys.argv[1], sys.argv[2]
def best(engine, key):
    return max(json.load(open(f))[key] for f in glob.glob(f"{out}/{tag}-{engine}-*.json"))
rows = []
for key in ("prefill_tok_s", "decode_tok_s"):
    n, l = best("nibble", key), best("llamacpp", key)
    rows.append((key, n, l, n / l))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
summary = {"tag": tag, "commit": commit, "cpu": cpu, "rows": [dict(metric=k, nibble=n, llamacpp=l, ratio=r) for k, n, l, r in rows]}
json.dump(summary, open(f"{out}/{tag}-summary.json", "w"), indent=2)
print(f"{tag} commit {commit} on {cpu}")
for k, n, l, r in rows:
    print(f"  {k:14s} nibble {n:8.1f}  llama.cpp {l:8.1f}  ratio {r:.2f}")
PY
