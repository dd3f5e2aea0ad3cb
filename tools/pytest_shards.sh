#!/usr/bin/env bash
# Runs one pytest command as N processes side by side (`make integration`, INTEGRATION_SHARDS; docs/development/testing.md).
# Usage: tools/pytest_shards.sh N DURATIONS LOG_DIR -- pytest [args...]
# For a box with cores to spare (on CI's 2 cores two processes contend for the CPU and gain next to nothing).
# pytest-split cuts the collected tests into N contiguous chunks of equal measured time (DURATIONS, refreshed with
# `make integration PYTEST_ARGS=--store-durations`): a module stays in one process, its replicas are started once,
# and each process keeps the session's order.
# Shard 1 prints live; the others write LOG_DIR/shard-K.log, printed when they end. The exit status is pytest's:
# 0 when every shard passed (a shard that a -k or -m left without tests is not a failure), else the first failing
# shard's, 5 when no shard ran a test.
set -uo pipefail
shards=${1:-}; durations=${2:-}; log_dir=${3:-}
if [ "${4:-}" != "--" ] || [ "$#" -lt 5 ]; then
  echo "usage: $0 N DURATIONS LOG_DIR -- pytest [args...]" >&2
  exit 2
fi
shift 4
case "$shards" in
  '' | *[!0-9]* | 0) echo "INTEGRATION_SHARDS must be a whole number of processes, 1 or more (got '$shards')" >&2; exit 2 ;;
esac
if [ "$shards" -eq 1 ]; then
  exec "$@" --durations-path "$durations"  # where --store-durations writes
fi

mkdir -p "$log_dir"
pids=()
stop_shards() {
  local pid
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
}
# Ctrl-C reaches every shard and the runner waits for them: their fixtures stop their replicas, none is left holding
# them. Each shard runs in a subshell: a script's plain background command would start with Ctrl-C ignored.
trap 'stop_shards; wait; exit 130' INT TERM
split=(--splits "$shards" --durations-path "$durations" --splitting-algorithm duration_based_chunks)
for shard in $(seq 2 "$shards"); do
  (exec "$@" "${split[@]}" --group "$shard") >"$log_dir/shard-$shard.log" 2>&1 &
  pids+=("$!")
  echo "==> integration shard $shard of $shards started in the background: $log_dir/shard-$shard.log"
done
echo "==> integration shard 1 of $shards"
codes=(0)
"$@" "${split[@]}" --group 1 || codes[0]=$?
for index in "${!pids[@]}"; do
  shard=$((index + 2))
  code=0
  wait "${pids[$index]}" || code=$?
  codes+=("$code")
  echo "==> integration shard $shard of $shards (exit $code): $log_dir/shard-$shard.log"
  cat "$log_dir/shard-$shard.log"
done

ran=0
for code in "${codes[@]}"; do
  case "$code" in
    0) ran=1 ;;
    5) ;;
    *) echo "==> integration shards: exit codes ${codes[*]}" >&2; exit "$code" ;;
  esac
done
[ "$ran" -eq 1 ] || exit 5
