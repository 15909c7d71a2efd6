# Helpers the GPU scripts share; sourced, not run.

# step NAME COMMAND...: runs COMMAND with its output in $out/NAME.log, prints the exit status and
# time, the log lines matching $STEP_SUMMARY (a grep -E pattern) if set, and on failure the log's
# tail, and sets status=1.
step() {
  local name=$1; shift
  echo "== $name"
  local t0=$(date +%s)
  local rc=0
  "$@" >"$out/$name.log" 2>&1 || rc=$?
  echo "   exit $rc after $(( $(date +%s) - t0 ))s"
  if [ -n "${STEP_SUMMARY:-}" ]; then grep -E "$STEP_SUMMARY" "$out/$name.log" | head -40; fi
  if [ $rc -ne 0 ]; then status=1; tail -40 "$out/$name.log"; fi
}

# model_flags MODEL: how nibble loads MODEL, a model directory or a dummy-weights name.
model_flags() {
  if [ -d "$1" ]; then echo --model "$1"; else echo --dummy-weights "$1"; fi
}

# start_server PORT TRIES COMMAND...: starts a server in the background, stops it when the
# calling script exits, and waits up to TRIES half-seconds for its /health; fails if it never
# answers.
start_server() {
  local port=$1 tries=$2; shift 2
  "$@" &
  server_pid=$!
  trap 'kill $server_pid 2>/dev/null || true' EXIT
  for _ in $(seq "$tries"); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 0.5
  done
  echo "server did not come up on port $port" >&2
  return 1
}

# seed_kernel_cache: unpacks .gpu-cache/kernels.tar.xz.* (NVRTC's compiled kernels, brought back
# from an earlier run with SAVE_KERNELS=1 as $out/kernels.tar.xz.NN, 15 MB parts since a call
# returns no file over 16 MiB) into $NIBBLE_KERNEL_CACHE, so a fresh machine does not spend its
# first minutes compiling; kernels whose source changed since are compiled as usual (the cache is
# keyed by source hash).
seed_kernel_cache() {
  if compgen -G ".gpu-cache/kernels.tar.xz.*" >/dev/null && [ ! -d "$NIBBLE_KERNEL_CACHE" ]; then
    mkdir -p "$NIBBLE_KERNEL_CACHE"
    # A broken archive (parts of two saves mixed) must not leave a half-seeded cache behind.
    cat .gpu-cache/kernels.tar.xz.* | tar xJf - -C "$NIBBLE_KERNEL_CACHE" --strip-components=1 \
      || { echo "seed_kernel_cache: .gpu-cache/kernels.tar.xz.* did not unpack; compiling instead" >&2
           rm -rf "$NIBBLE_KERNEL_CACHE"; }
  fi
}

# save_kernel_cache: with SAVE_KERNELS=1, packs $NIBBLE_KERNEL_CACHE into $out/kernels.tar.xz.NN
# (copy them to .gpu-cache/ in place of the old parts: a stale higher-numbered part would be
# joined on).
save_kernel_cache() {
  if [ "${SAVE_KERNELS:-0}" = 1 ] && [ -d "$NIBBLE_KERNEL_CACHE" ]; then
    rm -f "$out"/kernels.tar.xz.*
    tar cf - -C "$(dirname "$NIBBLE_KERNEL_CACHE")" "$(basename "$NIBBLE_KERNEL_CACHE")" \
      | xz -T0 -6 | split -b 15000000 -d - "$out/kernels.tar.xz."
  fi
}

# warm_kv STAGE: compiles every kernel module a context makes and the KV formats' the GPU tests
# use, side by side into $NIBBLE_KERNEL_CACHE (`nibble kernels`), before tests that would compile
# the KV ones one pool at a time (about 10 s each). With a seed from scripts/gpu-precompile.sh it
# finds them all cached. Its time goes to stderr; a failure is reported and the tests compile what
# is missing themselves.
warm_kv() {
  local t0=$(date +%s)
  NIBBLE_KERNEL_CACHE=$NIBBLE_KERNEL_CACHE "$1/nibble" kernels 2>&1 | tail -2 >&2 \
    || echo "warm_kv: $1/nibble kernels failed" >&2
  echo "warm_kv: $(( $(date +%s) - t0 ))s" >&2
}
