#!/usr/bin/env bash
# Runs a command bounded in time and memory, for benchmarks on a shared
# machine (2 cores, 24 GiB here): the command runs in its own process group,
# and the whole group is stopped (TERM, then KILL after 10 s) when it runs
# past SECONDS, or when the machine's MemAvailable (/proc/meminfo) falls
# below MIN_AVAILABLE_MIB. Exits with the command's status, or 124 (time)
# or 125 (memory) after saying which bound stopped it. $WATCHDOG_CLEANUP, if
# set, is run (bash -c) once the command has ended, however it ended: it
# stops what the command started outside its process group.
#
#   tools/watchdog.sh SECONDS MIN_AVAILABLE_MIB -- COMMAND [ARGS...]
set -euo pipefail
if (($# < 4)) || [[ $3 != -- ]]; then
  echo "usage: $0 SECONDS MIN_AVAILABLE_MIB -- COMMAND [ARGS...]" >&2
  exit 2
fi
limit=$1 min_mib=$2
shift 3
setsid "$@" &
pid=$!
stop() {
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
}
cleanup() {
  if [[ -n ${WATCHDOG_CLEANUP:-} ]]; then
    bash -c "$WATCHDOG_CLEANUP" || echo "watchdog: cleanup failed" >&2
  fi
}
trap 'stop; cleanup; exit 130' INT TERM
start=$SECONDS
while kill -0 "$pid" 2>/dev/null; do
  available=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
  if ((available < min_mib)); then
    echo "watchdog: MemAvailable ${available} MiB < ${min_mib} MiB: stopping $*" >&2
    stop
    wait "$pid" 2>/dev/null || true
    cleanup
    exit 125
  fi
  if ((SECONDS - start >= limit)); then
    echo "watchdog: ${limit} s passed: stopping $*" >&2
    stop
    wait "$pid" 2>/dev/null || true
    cleanup
    exit 124
  fi
  sleep 1
done
rc=0
wait "$pid" || rc=$?
cleanup
exit "$rc"
