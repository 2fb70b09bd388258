#!/usr/bin/env bash
# `make test`: every test of the workspace — unit, property, and end-to-end
# against the local control plane. Brings the plane up if it is not running
# — from fresh state, so objects left by an earlier run (pods whose IPs a
# restarted KWOK no longer knows) cannot interfere — and, in that case,
# tears it down afterwards (a plane left by `make demo` is used and left
# running). Prometheus and the pod runner, which tests start
# on demand (tests/cluster/prometheus.sh, pod-runner.sh), are stopped in both
# cases.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/cluster/env.sh"

started=
if ! KUBECONFIG=$KUBECONFIG_PATH kubectl get --raw /readyz >/dev/null 2>&1; then
  started=1
fi
cleanup() {
  # The metrics harness (started by tests on demand) stops either way.
  bash "$here/cluster/pod-runner.sh" stop >/dev/null 2>&1 || true
  bash "$here/cluster/prometheus.sh" stop >/dev/null 2>&1 || true
  if [[ -n "$started" ]]; then bash "$here/cluster/down.sh" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
if [[ -n "$started" ]]; then
  bash "$here/cluster/down.sh" --purge >/dev/null
fi
bash "$here/cluster/up.sh"
# A demo operator watching every namespace would reconcile the tests' fleets too.
bash "$here/demo.sh" --stop
export C10M_KUBECONFIG=$KUBECONFIG_PATH
C10M_BIN_DIR=$(bash "$here/cluster/build.sh" | tail -n1)
export C10M_BIN_DIR
cd "$here/.."
cargo test --workspace --no-fail-fast
