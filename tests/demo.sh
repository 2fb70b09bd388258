#!/usr/bin/env bash
# `make demo [CLUSTER=local|current]`: brings the local control plane up (or
# uses your current kubectl context with CLUSTER=current), applies the CRD,
# starts the operator in the background, applies crds/examples/, waits until
# every fleet is Ready and prints them with their plans.
# `demo.sh --stop` stops the demo operator.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
source "$here/cluster/env.sh"
operator=$root/target/debug/c10m-operator
pidfile=$C10M_STATE/operator.pid

stop_operator() {
  if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    kill "$(cat "$pidfile")" && echo "stopped c10m-operator ($(cat "$pidfile"))"
  fi
  rm -f "$pidfile"
}

mode=${1:-local}
case $mode in
  --stop) stop_operator; exit 0 ;;
  local)
    bash "$here/cluster/up.sh"
    export KUBECONFIG=$KUBECONFIG_PATH
    ;;
  current)
    kubectl config current-context >/dev/null || { echo "error: CLUSTER=current needs a kubectl context" >&2; exit 1; }
    echo "using kubectl context $(kubectl config current-context)"
    ;;
  *) echo "error: CLUSTER must be local or current, got '$mode'" >&2; exit 1 ;;
esac

kubectl apply --server-side --force-conflicts -f "$root/crds/connectionfleet.yaml"
# Polled first: kubectl wait fails at once (".status.conditions accessor
# error") on a CRD the API server has not yet given any condition. The wait
# after it reports a CRD still not Established after 60 s.
established='jsonpath={.status.conditions[?(@.type=="Established")].status}'
for _ in $(seq 120); do
  [ "$(kubectl get crd/connectionfleets.c10m.dev -o "$established")" = True ] && break
  sleep 0.5
done
kubectl wait --for=condition=Established --timeout=1s crd/connectionfleets.c10m.dev

mkdir -p "$C10M_STATE"
stop_operator
log=$C10M_STATE/operator.log
setsid nohup "$operator" run --metrics-addr 127.0.0.1:8080 >"$log" 2>&1 </dev/null &
echo $! >"$pidfile"
echo "started c10m-operator (pid $(cat "$pidfile"), log $log)"

kubectl apply -f "$root/crds/examples/"
if ! kubectl wait --for=condition=Ready connectionfleets --all --timeout=120s; then
  echo "fleets not Ready in 120 s; operator log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
echo
kubectl get connectionfleets -o wide
echo
"$operator" status
if [[ $mode == local ]]; then
  echo "# the cluster stays up; \`make down\` stops it"
  echo "export KUBECONFIG=$KUBECONFIG_PATH"
fi
