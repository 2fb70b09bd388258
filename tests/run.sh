#!/usr/bin/env bash
# `make test`: every test of the workspace — unit, property, and end-to-end
# against the local control plane and its real node. Brings the plane up if
# it is not running — from fresh state, so objects left by an earlier run
# (pods whose IPs a restarted KWOK no longer knows) cannot interfere — and,
# in that case, tears it down afterwards (a plane left by `make demo` is used
# and left running) and checks that the host is as it was before: the
# listing of tests/cluster/host-state.sh (mounts, cgroups, links, iptables,
# the sysctls kubelet touches) taken before up.sh must equal the one taken
# after down.sh, or the run fails with the diff (both listings are kept in
# $C10M_CACHE/host-state-{before,after}.txt). Prometheus and the pod runner,
# which tests start on demand (tests/cluster/prometheus.sh, pod-runner.sh),
# are stopped in both cases.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/cluster/env.sh"

started=
if ! KUBECONFIG=$KUBECONFIG_PATH kubectl get --raw /readyz >/dev/null 2>&1; then
  started=1
fi
before=$C10M_CACHE/host-state-before.txt
after=$C10M_CACHE/host-state-after.txt
cleanup() {
  local rc=$?
  # The metrics harness (started by tests on demand) stops either way.
  bash "$here/cluster/pod-runner.sh" stop >/dev/null 2>&1 || true
  bash "$here/cluster/prometheus.sh" stop >/dev/null 2>&1 || true
  if [[ -n "$started" ]]; then
    if ! out=$(bash "$here/cluster/down.sh" 2>&1); then
      echo "$out" >&2
      echo "run.sh: down.sh failed" >&2
      ((rc != 0)) || rc=1
    fi
    if [[ -f "$before" ]]; then
      bash "$here/cluster/host-state.sh" >"$after"
      if ! diff "$before" "$after" >"$after.diff"; then
        echo "run.sh: the host is not as it was before up.sh (host-state.sh; < before, > after):" >&2
        cat "$after.diff" >&2
        ((rc != 0)) || rc=1
      fi
      rm -f "$after.diff"
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
if [[ -n "$started" ]]; then
  rm -f "$before" "$after"
  bash "$here/cluster/down.sh" --purge >/dev/null
  mkdir -p "$C10M_CACHE"
  bash "$here/cluster/host-state.sh" >"$before"
fi
bash "$here/cluster/up.sh"
# A demo operator watching every namespace would reconcile the tests' fleets too.
bash "$here/demo.sh" --stop
export C10M_KUBECONFIG=$KUBECONFIG_PATH
C10M_BIN_DIR=$(bash "$here/cluster/build.sh" | tail -n1)
export C10M_BIN_DIR
cd "$here/.."
cargo test --workspace --no-fail-fast
