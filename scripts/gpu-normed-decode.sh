#!/usr/bin/env bash
# The one-token W4A16 decode gemv that norms its own input (qlinear::NormedDecode) on the
# GPU machine, from the repo root with stage/gpu staged (scripts/gpu-stage.sh):
#   scripts/gpu-normed-decode.sh OUTDIR
# The GPU tests the change touches (the normed gemvs against the norm kernel and then the gemv,
# the W4A16 and W8A16 kernels, the quantized checkpoints against the CPU, graph replay), then
# Llama-3-8B W4A16 decode steps with the norm in the gemv (default) and without
# (NIBBLE_NORMED_DECODE=0), ROUNDS (default 2) alternated; OUTDIR/steps-w4a16.md compares them.
# (W8A16's normed entries were measured with it and dropped: BENCHMARKS.md, issue 18.)
# PROFILE=1 adds Nsight Compute's per-kernel breakdown of a W4A16 one-token step both ways
# (needs stage/gpu/nibble; about 100 s each).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-normed-decode.sh OUTDIR}
mkdir -p "$out"
status=0
AB_TEST_STAGE=stage/gpu AB_TESTS="normed qgemm::w4a16 qgemm::w8a16 qgemm::split_k quantized_models graph_replay" \
  AB_BENCH="--decode-steps 1,8 --spec w4a16-g128" \
  scripts/gpu-abn.sh "$out/w4a16" fused=stage/gpu off=stage/gpu@NIBBLE_NORMED_DECODE=0 || status=1
if [ -n "${PROFILE:-}" ]; then
  for v in 1 0; do
    NIBBLE_NORMED_DECODE=$v COUNT=8000 SKIP=4000 timeout 240 \
      scripts/gpu-profile-step.sh "$out/prof-normed$v" w4a16-g128 >/dev/null 2>&1 || status=1
  done
fi
python3 bench/ab_report.py "$out/w4a16" --base off --cand fused | tee "$out/steps-w4a16.md"
exit $status
