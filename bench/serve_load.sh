#!/usr/bin/env bash
# Load figures for the server on this machine: 64 concurrent streaming clients with ShareGPT
# prompts against `nibble serve` (default model), once with room for everyone and once with a
# small admission queue so overload is answered with 429. Records the server's peak memory.
# Usage: bench/serve_load.sh [NUM_PROMPTS]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q -p nibble-cli
N="${1:-128}"
OUT=bench/results; mkdir -p "$OUT"; TAG="serve-$(date -u +%Y%m%d-%H%M)"
run() {  # name, port, server args...
  local name=$1 port=$2; shift 2
  target/release/nibble serve --port "$port" "$@" > "$OUT/$TAG-$name-server.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.2; done
  target/release/nibble bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$N" \
    --max-concurrency 64 --json "$OUT/$TAG-$name.json" | tee "$OUT/$TAG-$name.txt"
  curl -s "http://127.0.0.1:$port/metrics" > "$OUT/$TAG-$name-metrics.txt"
  grep -E 'VmHWM|VmRSS' "/proc/$pid/status" | tee -a "$OUT/$TAG-$name.txt"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
run roomy 8411
run overload 8412 --max-num-seqs 16 --max-waiting 8
echo "results in $OUT/$TAG-*"
