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
python3 - "$OUT" "$TAG" "$THREADS" <<'PY'
import glob, json, os, platform, subprocess, sys
out, tag, threads = sys.argv[1], sys.argv[2], sys.argv[3]
def runs(engine):
    rs = []
    for f in sorted(glob.glob(f"{out}/{tag}-{engine}-*.json")):
        for r in json.load(open(f))["runs"]:
            rs.append((r["prefill_tok_s"], r["decode_tok_s"]) if isinstance(r, dict) else tuple(r))
    return rs
# Best run of each engine: on a shared machine other work can only slow a run down.
n, l = runs("nibble"), runs("llamacpp")
rows = []
for i, key in enumerate(("prefill_tok_s", "decode_tok_s")):
    nb, lb = max(r[i] for r in n), max(r[i] for r in l)
    rows.append(dict(metric=key, nibble=nb, llamacpp=lb, ratio=nb / lb))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), platform.processor())
summary = {"tag": tag, "commit": commit, "cpu": cpu, "threads": int(threads), "loadavg": os.getloadavg(),
           "nibble_runs": n, "llamacpp_runs": l, "rows": rows}
json.dump(summary, open(f"{out}/{tag}-summary.json", "w"), indent=2)
print(f"{tag} commit {commit} on {cpu}, {threads} threads, load {os.getloadavg()[0]:.2f}")
for r in rows:
    print(f"  {r['metric']:14s} nibble {r['nibble']:8.1f}  llama.cpp {r['llamacpp']:8.1f}  ratio {r['ratio']:.2f}")
PY
