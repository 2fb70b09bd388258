#!/usr/bin/env bash
# Stops the local control plane started by up.sh (by pid file: TERM, then
# KILL after 15 s), the real node first (node.sh down: its pods, kubelet,
# containerd, and everything they left on the host). Idempotent.
#
#   down.sh           stop every component; keep the state (etcd data, PKI,
#                     the node's images)
#   down.sh --purge   also delete $C10M_STATE (never the binary cache)
set -euo pipefail
export LC_ALL=C
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"

purge=
for arg in "$@"; do
  case $arg in
    --purge) purge=1 ;;
    -h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $arg (try --help)" ;;
  esac
done

if [[ ! -d "$C10M_STATE" ]]; then
  echo "down: nothing to do ($C10M_STATE does not exist)"
  exit 0
fi

# The real node first: its pods are deleted through the apiserver.
rc=0
if ! bash "$here/node.sh" down; then
  echo "down: node.sh down failed" >&2
  rc=1
fi

# The harness's daemons next: they are clients of the apiserver.
bash "$here/pod-runner.sh" stop || echo "down: pod-runner.sh stop failed" >&2
bash "$here/prometheus.sh" stop || echo "down: prometheus.sh stop failed" >&2

take_lock

# Processes of this plane whose pid files were lost (running a cached plane
# binary with this state directory on their command line) are stopped with
# their component, so clients always go before the apiserver and etcd.
orphans=$(plane_orphans)
stop_orphans() { # NAME, or "" for any
  local pid name
  for pid in $orphans; do
    pid_alive "$pid" || continue
    name=$(exe_name "$pid") || continue
    [[ -z "$1" || "$name" == "$1" ]] || continue
    stop_pid "untracked $name" "$pid"
    stopped=$((stopped + 1))
  done
}

stopped=0
for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
  name=${COMPONENTS[i]}
  if running_pid "$name" >/dev/null; then
    stop_component "$name"
    stopped=$((stopped + 1))
  elif [[ -e "$PIDS/$name.pid" ]]; then
    echo "$name: not running; removing stale pid file"
  fi
  rm -f "$PIDS/$name.pid" "$PIDS/$name.cmd"
  stop_orphans "$name"
done
stop_orphans ""

if ((stopped == 0)); then
  echo "down: no component was running"
else
  echo "down: stopped $stopped process(es)"
fi

if [[ -n "$purge" ]]; then
  state=$(realpath -m "$C10M_STATE")
  for bad in / "$(realpath -m "$HOME")" "$(realpath -m "$C10M_CACHE")" "$(realpath -m "$C10M_CACHE/bin")"; do
    [[ "$state" != "$bad" ]] || die "refusing to purge C10M_STATE=$C10M_STATE"
  done
  [[ "$(realpath -m "$C10M_CACHE/bin")/" != "$state/"* ]] || die "refusing to purge $state: it contains the binary cache"
  # rm -rf must never walk into a mounted filesystem (a container's rootfs
  # bind-mounts host paths).
  mounted=$(awk -v d="$state" '{ m = $5; gsub(/\\040/, " ", m); if (m == d || index(m, d "/") == 1) print m }' /proc/self/mountinfo)
  [[ -z "$mounted" ]] || die "refusing to purge $state: still mounted there: $mounted"
  rm -rf --one-file-system "$state"
  echo "down: purged $state"
fi
exit "$rc"
