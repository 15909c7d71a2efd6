#!/usr/bin/env bash
# End-to-end A/B of staged builds in one device call: `scripts/gpu-engine-run.sh w4a8` (W4A8 and
# BF16 offline on 1000 ShareGPT prompts; PART names another of its throughput parts) for each stage, alternated ROUNDS times (default 1), at
# SEQS sequences (default 256). Everything lands in OUTDIR/e2e.tgz plus OUTDIR/summary.md (one
# row per stage, round and precision), so the call returns two files whatever the stage count.
#   scripts/gpu-e2e-ab.sh OUTDIR STAGE...      (GPU machine, repo root; STAGE a folder with nibble)
# A STAGE may be NAME=FOLDER, and either may end in @VAR=VALUE[,VAR=VALUE]: that build with probe
# knobs set, A/B'd against itself (e.g. fused=stage/gpu off=stage/gpu@NIBBLE_SWIGLU=0).
# A run gets E2E_TIMEOUT seconds (default 320: on a cold machine the first run compiles every module
# first, and 200 s cut a cold W4A8 + BF16 run at 64 and 256 sequences short); mind the device
# call's 600 s: stages x rounds x a run's time (about 150 s warm at 64 and 256) must fit. The
# summary is redrawn after every run, so a call cut short keeps what finished. A cold machine
# compiles every module first (2 to 4 minutes): .gpu-cache/kernels.tar.xz.* seeds the cache
# (scripts/gpu-pack.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-e2e-ab.sh OUTDIR STAGE...}; shift
mkdir -p "$out/runs"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
status=0
for round in $(seq 1 "${ROUNDS:-1}"); do
  for spec in "$@"; do
    st=$spec knob=
    if [[ $st == *@* ]]; then knob=${st#*@}; st=${st%%@*}; fi
    name=$(basename "$st")
    if [[ $st == *=* ]]; then name=${st%%=*}; st=${st#*=}; fi
    dir="$out/runs/$name-$round"
    # shellcheck disable=SC2086 # knob: VAR=VALUE words for env
    env ${knob//,/ } SEQS="${SEQS:-256}" STAGE="$st" SAVE_KERNELS=0 timeout "${E2E_TIMEOUT:-320}" \
      scripts/gpu-engine-run.sh "$dir" "${PART:-w4a8}" >"$dir.log" 2>&1 || status=1
    # A run cut short by its timeout can leave its nibble behind, holding GPU memory the next
    # stage then lacks (and running beside it): end it, and wait for the GPU to be free.
    pkill -KILL -f "$st/nibble" 2>/dev/null || true
    free=0
    for _ in $(seq 30); do
      apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader) && [ -z "$apps" ] && { free=1; break; }
      sleep 1
    done
    [ $free = 1 ] || echo "gpu-e2e-ab: the GPU still runs something after $name: the next stage may share it" >&2
    grep -E "^throughput at" "$dir.log" | sed "s|^|$name round $round: |"
    python3 bench/e2e_ab_report.py "$out/runs" >"$out/summary.md"
  done
done
cat "$out/summary.md"
tar czf "$out/e2e.tgz" -C "$out" runs && rm -rf "$out/runs"
save_kernel_cache  # (SAVE_KERNELS=1: once, not per run)
exit $status
