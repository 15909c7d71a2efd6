#!/usr/bin/env bash
# The device call behind bench/results/decode-cap-20261126-h100: a staged build in stage/cand
# (scripts/gpu-stage.sh), its qgemm GPU tests, the decode-cap probe and ncu on four wgmma entries.
#   run from the repo root on the GPU machine: bash bench/probe/decode_cap_call.sh (OUT set)
set -u
export NIBBLE_KERNEL_CACHE=/tmp/nibble-kernels; source scripts/gpu-lib.sh; seed_kernel_cache
mkdir -p $OUT/r
# qgemm tests of the candidate (W8A16 128-channel stages), kernels compile meanwhile for the bench
(stage/cand/gpu-bench /tmp/w.json --qgemm --kernels-only --ms 16,64,256 >/dev/null 2>&1) &
stage/cand/gpu-tests qgemm --test-threads 1 > $OUT/r/tests.log 2>&1; echo "tests exit $?: $(grep 'test result' $OUT/r/tests.log)"
wait
timeout 150 bench/probe/decode_cap_probe.sh $OUT/r/cap 8,12,16,20,24,28,32 plan,16,8 stage/cand
python3 bench/probe/wgmma_splits_report.py $OUT/r/cap > /dev/null
for spec in "w4a8_wgmma64 64" "w8a8_wgmma64 64" "w4a8_wgmma128 256" "w4a8_wgmma_ 1024"; do
  set -- $spec
  timeout 60 ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats -k regex:$1 -c 1 stage/cand/gpu-bench /tmp/n.json --qgemm --kernels-only --ms $2 > $OUT/r/ncu-$1-$2.txt 2>&1
  echo "ncu $1 exit $?"
done
cd $OUT/r && tar czf ../r.tgz . 
