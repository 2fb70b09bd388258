#!/usr/bin/env bash
# Runs c10m-pod-runner (tests/src/bin) in the background: a real c10m-server
# bound to the IP of every Running fleet pod on the KWOK nodes (pods
# labelled app.kubernetes.io/managed-by=c10m-operator), stopped (SIGTERM,
# SIGKILL after the pod's grace period) when the pod goes away.
#
#   pod-runner.sh start   start it unless it runs with the same binaries
#                         (idempotent); builds it with
#                         `cargo build -p c10m-e2e --bins` unless
#                         $C10M_E2E_BIN_DIR holds it
#   pod-runner.sh stop    TERM (it TERMs every server and waits up to 10 s),
#                         then KILL after 15 s (idempotent)
#
# The server binary: $C10M_SERVER_BIN, default target/debug/c10m-server
# (`cargo build -p c10m-server`). Logs: $C10M_STATE/logs/c10m-pod-runner.log,
# one $C10M_STATE/logs/pods/<namespace>_<pod>.log per server; pid:
# $C10M_STATE/pids/c10m-pod-runner.pid.
set -euo pipefail
export LC_ALL=C
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
root=$(cd "$here/../.." && pwd)

NAME=c10m-pod-runner # pid file name = executable base name (lib.sh running_pid)
POD_LOGS=$LOGS/pods
SERVER_BIN=${C10M_SERVER_BIN:-$root/target/debug/c10m-server}

lock() {
  mkdir -p "$C10M_STATE"
  exec 8>"$C10M_STATE/.pod-runner.lock"
  flock -w 300 8 || die "another pod-runner.sh holds $C10M_STATE/.pod-runner.lock"
}

# For launch (lib.sh): a runner started with the same binaries is kept.
healthy_c10m-pod-runner() { true; }

start() {
  [[ -f "$KUBECONFIG_PATH" ]] || die "$KUBECONFIG_PATH not found; run $here/up.sh first"
  local bin cmd record pid i off
  if [[ -n "${C10M_E2E_BIN_DIR:-}" ]]; then
    bin=$C10M_E2E_BIN_DIR/$NAME
  else
    (cd "$root" && cargo build -q -p c10m-e2e --bins) >&2 || die "cargo build -p c10m-e2e --bins failed"
    bin=$root/target/debug/$NAME
  fi
  [[ -x "$bin" ]] || die "$bin not found"
  [[ -x "$SERVER_BIN" ]] || die "$SERVER_BIN not found: run cargo build -p c10m-server"
  lock
  mkdir -p "$PIDS" "$LOGS" "$POD_LOGS"
  cmd=(env KUBECONFIG="$KUBECONFIG_PATH" "$bin" --server-bin "$SERVER_BIN" --log-dir "$POD_LOGS")
  # A rebuilt runner or server restarts the runner (and so every server).
  record="$(printf '%q ' "${cmd[@]}")# $(cat "$bin" "$SERVER_BIN" | sha256sum | cut -c1-16)"
  off=$(stat -c %s "$LOGS/$NAME.log" 2>/dev/null || echo 0)
  launch "$NAME" "$record" "${cmd[@]}" || return 0
  pid=$(cat "$PIDS/$NAME.pid")
  # Up once it has logged that it watches (or at least is alive after 10 s).
  for ((i = 0; i < 100; i++)); do
    pid_alive "$pid" || { log_tail "$NAME"; die "$NAME (pid $pid) exited during startup"; }
    tail -c "+$((off + 1))" "$LOGS/$NAME.log" | grep 'watching pods' >/dev/null && [[ "$(exe_name "$pid")" == "$NAME" ]] && break
    sleep 0.1
  done
  echo "  $NAME: watching pods (servers' logs $POD_LOGS)"
}

stop() {
  lock
  stop_component "$NAME"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) die "usage: $0 start|stop" ;;
esac
