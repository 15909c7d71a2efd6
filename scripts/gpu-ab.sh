#!/usr/bin/env bash
# A/B of two staged builds' kernels on one GPU, in one device call: the candidate's GPU tests
# (qgemm by default), then a benchmark (`gpu-bench --qgemm --kernels-only` by default) from the
# base build and from the candidate, alternated twice so that clock drift shows as run-to-run
# spread, not as a difference (scripts/gpu-abn.sh with two stages named base and cand).
#   scripts/gpu-ab.sh OUTDIR BASE_STAGE CAND_STAGE [MS]
# A stage is a folder holding gpu-bench (and, for the candidate, gpu-tests), e.g. stage/gpu from
# scripts/gpu-stage.sh on main and another from the branch. MS: the token counts (default
# 1,4,16,17,24,32). AB_ENGINE=1 adds the engine's decode steps per precision (the Llama-3-8B
# shape) to each bench run. AB_BENCH replaces the bench's arguments (e.g. "--moe-experts", with
# NIBBLE_BENCH_FORMATS / NIBBLE_BENCH_TOKENS to narrow it, or "--kv-attention") and AB_TESTS the
# test filters (default qgemm). `python3 bench/ab_report.py OUTDIR` makes the table and plot.
# Logs and JSON go to OUTDIR (a tarball of the logs: a call returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-ab.sh OUTDIR BASE_STAGE CAND_STAGE [MS]}
base=${2:?base stage}; cand=${3:?candidate stage}; ms=${4:-1,4,16,17,24,32}
kernels_only=--kernels-only; [ "${AB_ENGINE:-0}" = 1 ] && kernels_only=
export AB_BENCH=${AB_BENCH:---qgemm $kernels_only --ms $ms}
AB_TEST_STAGE=$cand exec scripts/gpu-abn.sh "$out" "base=$base" "cand=$cand"
