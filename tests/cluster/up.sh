#!/usr/bin/env bash
# Brings up the local Kubernetes control plane: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kwok with fake nodes, all on
# 127.0.0.1, state in $C10M_STATE (see env.sh, lib.sh), then the real node
# (node.sh: kubelet + containerd; C10M_REAL_NODE=0 leaves it out).
# Idempotent: healthy components already running with the same command line
# are left alone.
#
#   up.sh            start (or check) the plane
#   up.sh --smoke    also schedule a pod onto a KWOK node, wait for Running,
#                    delete it
#
# The last line printed is `export KUBECONFIG=<path>`.
set -euo pipefail
export LC_ALL=C
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"

smoke=
for arg in "$@"; do
  case $arg in
    --smoke) smoke=1 ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $arg (try --help)" ;;
  esac
done

t0=$EPOCHREALTIME
t_step=$t0
elapsed() { # seconds since $1, one decimal
  awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'
}
step_done() {
  echo "  [$(elapsed "$t_step") s] $1"
  t_step=$EPOCHREALTIME
}

for cmd in curl openssl kubectl flock setsid ss awk base64; do
  command -v "$cmd" >/dev/null || die "$cmd not found; run $here/install-deps.sh"
done
KUBECTL=$(command -v kubectl)

# ---------------------------------------------------------------- binaries
echo "up: binaries"
mkdir -p "$C10M_CACHE"
# One build at a time (a cold build takes tens of minutes on 2 cores).
build_out=$(flock -w 3600 "$C10M_CACHE/.build.lock" "$here/build.sh") || die "build.sh failed"
BIN=$(tail -n1 <<<"$build_out")
[[ -x "$BIN/kube-apiserver" ]] || die "build.sh printed '$BIN', which holds no kube-apiserver"
step_done "binaries in $BIN"

take_lock
mkdir -p "$PIDS" "$LOGS" "$KUBECONFIGS"

# ---------------------------------------------------------------- PKI
# (new_ca, new_cert, client_ext and write_kubeconfig are in lib.sh.)
# Front proxy (aggregation layer) CA and the apiserver's client cert for it.
make_front_proxy_pki() {
  local dir=$1
  new_ca "$dir" front-proxy-ca c10m-front-proxy-ca
  new_cert "$dir" front-proxy-ca front-proxy-client "/CN=front-proxy-client" "$client_ext"
  chmod 600 "$dir"/front-proxy-*.key
}

# The apiserver's client cert for the kubelet API (logs, exec, port-forward
# on the real node, whose kubelet authenticates clients with the plane's CA).
make_kubelet_client_pki() {
  new_cert "$1" ca apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client_ext"
  chmod 600 "$1/apiserver-kubelet-client.key"
}

make_pki() {
  local tmp="$PKI.tmp" server_ext
  rm -rf "$tmp"
  mkdir -p "$tmp"
  chmod 700 "$tmp"
  new_ca "$tmp" ca c10m-local-ca
  server_ext="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
authorityKeyIdentifier=keyid
subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:$(ip4_add "${C10M_SERVICE_CIDR%/*}" 1)"
  new_cert "$tmp" ca apiserver "/CN=kube-apiserver" "$server_ext"
  new_cert "$tmp" ca admin "/O=system:masters/CN=c10m-admin" "$client_ext"
  new_cert "$tmp" ca kube-controller-manager "/CN=system:kube-controller-manager" "$client_ext"
  new_cert "$tmp" ca kube-scheduler "/CN=system:kube-scheduler" "$client_ext"
  new_cert "$tmp" ca kwok "/O=system:masters/CN=kwok-controller" "$client_ext"
  make_front_proxy_pki "$tmp"
  make_kubelet_client_pki "$tmp"

  # Service-account token signing key pair.
  openssl genrsa -out "$tmp/sa.key" 2048 2>/dev/null
  openssl rsa -in "$tmp/sa.key" -pubout -out "$tmp/sa.pub" 2>/dev/null

  # Static bearer token for scripts (member of system:masters).
  openssl rand -hex 32 >"$tmp/admin.token"
  printf '%s,c10m-admin-token,c10m-admin-token,system:masters\n' "$(cat "$tmp/admin.token")" >"$tmp/tokens.csv"

  chmod 600 "$tmp"/*.key "$tmp/admin.token" "$tmp/tokens.csv"
  touch "$tmp/.complete"
  rm -rf "$PKI"
  mv "$tmp" "$PKI"
}

echo "up: PKI"
if [[ -f "$PKI/.complete" ]]; then
  step_done "reusing $PKI"
else
  # New keys invalidate every existing token and certificate: start afresh.
  for name in "${COMPONENTS[@]}"; do
    if running_pid "$name" >/dev/null; then
      die "$PKI is incomplete but $name is running; run $here/down.sh first"
    fi
  done
  make_pki
  step_done "generated $PKI"
fi
if [[ ! -f "$PKI/front-proxy-client.crt" ]]; then # PKI from an older up.sh
  make_front_proxy_pki "$PKI"
  echo "  added the front-proxy CA to $PKI"
fi
if [[ ! -f "$PKI/apiserver-kubelet-client.crt" ]]; then # PKI from an older up.sh
  make_kubelet_client_pki "$PKI"
  echo "  added the apiserver's kubelet client cert to $PKI"
fi

write_kubeconfig "$KUBECONFIG_PATH" c10m-admin admin
write_kubeconfig "$KUBECONFIGS/kube-controller-manager.kubeconfig" system:kube-controller-manager kube-controller-manager
write_kubeconfig "$KUBECONFIGS/kube-scheduler.kubeconfig" system:kube-scheduler kube-scheduler
write_kubeconfig "$KUBECONFIGS/kwok.kubeconfig" kwok-controller kwok
k() { "$KUBECTL" --kubeconfig "$KUBECONFIG_PATH" --request-timeout=10s "$@"; }

# ---------------------------------------------------------------- processes
CURL=(curl -fsS --noproxy '*' --max-time 2)
healthy_etcd() { "${CURL[@]}" "http://127.0.0.1:$C10M_ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }
healthy_kube-apiserver() { [[ "$("${CURL[@]}" --cacert "$PKI/ca.crt" "https://127.0.0.1:$C10M_APISERVER_PORT/readyz" 2>/dev/null)" == ok ]]; }
healthy_kube-controller-manager() { [[ "$("${CURL[@]}" -k "https://127.0.0.1:$C10M_KCM_PORT/healthz" 2>/dev/null)" == ok ]]; }
healthy_kube-scheduler() { [[ "$("${CURL[@]}" -k "https://127.0.0.1:$C10M_SCHEDULER_PORT/healthz" 2>/dev/null)" == ok ]]; }
healthy_kwok() { "${CURL[@]}" "http://127.0.0.1:$C10M_KWOK_PORT/healthz" >/dev/null 2>&1; }

# port_owner PORT: describes who listens on 127.0.0.1:PORT (or any address), if anyone.
port_owner() {
  ss -Hltnp "( sport = :$1 )" 2>/dev/null | head -n1
}

# start NAME PORTS -- ARGS...: starts $BIN/NAME ARGS... detached unless a healthy
# instance with the same command line is already running. $FINGERPRINT, if
# set, is recorded with the command line; $PRESTART, if set, is a function
# run right before launching.
start() {
  local name=$1 ports=$2 pid record port owner
  shift 3
  local cmd=("$BIN/$name" "$@")
  record=$(printf '%q ' "${cmd[@]}")${FINGERPRINT:+"# $FINGERPRINT"}
  if pid=$(running_pid "$name"); then
    if [[ "$(cat "$PIDS/$name.cmd" 2>/dev/null)" == "$record" ]]; then
      if wait_healthy "$name" 20 quiet; then
        echo "  $name: already running and healthy (pid $pid)"
        return 0
      fi
      echo "  $name: running (pid $pid) but unhealthy for 20 s; restarting" >&2
      log_tail "$name" 20
    else
      echo "  $name: running (pid $pid) with another command line or binary; restarting"
    fi
    stop_component "$name"
  elif [[ -e "$PIDS/$name.pid" ]]; then
    echo "  $name: removing stale pid file (pid $(cat "$PIDS/$name.pid" 2>/dev/null))"
    rm -f "$PIDS/$name.pid" "$PIDS/$name.cmd"
  fi
  for port in $ports; do
    if owner=$(port_owner "$port") && [[ -n "$owner" ]]; then
      die "cannot start $name: port $port is already in use: $owner
(a plane started without pid files? try $here/down.sh)"
    fi
  done
  [[ -z "${PRESTART:-}" ]] || "$PRESTART"
  {
    echo
    echo "==== $(date -u +%FT%TZ) up.sh starting $name"
    echo "==== ${cmd[*]}"
  } >>"$LOGS/$name.log"
  # setsid: own session, so the process outlives this script and its
  # terminal; 9>&-: do not inherit the lock.
  setsid "${cmd[@]}" </dev/null >>"$LOGS/$name.log" 2>&1 9>&- &
  pid=$!
  echo "$pid" >"$PIDS/$name.pid"
  printf '%s' "$record" >"$PIDS/$name.cmd"
  echo "  $name: started (pid $pid, log $LOGS/$name.log)"
}

echo "up: etcd"
mkdir -p "$C10M_STATE/etcd"
chmod 700 "$C10M_STATE/etcd"
start etcd "$C10M_ETCD_PORT $C10M_ETCD_PEER_PORT" -- \
  --name=c10m \
  --data-dir="$C10M_STATE/etcd" \
  --listen-client-urls="http://127.0.0.1:$C10M_ETCD_PORT" \
  --advertise-client-urls="http://127.0.0.1:$C10M_ETCD_PORT" \
  --listen-peer-urls="http://127.0.0.1:$C10M_ETCD_PEER_PORT" \
  --initial-advertise-peer-urls="http://127.0.0.1:$C10M_ETCD_PEER_PORT" \
  --initial-cluster="c10m=http://127.0.0.1:$C10M_ETCD_PEER_PORT" \
  --initial-cluster-state=new \
  --initial-cluster-token=c10m \
  --unsafe-no-fsync=true \
  --quota-backend-bytes=4294967296 \
  --log-level=warn
wait_healthy etcd 60
step_done "etcd healthy on 127.0.0.1:$C10M_ETCD_PORT"

echo "up: kube-apiserver"
sa_issuer=https://kubernetes.default.svc.cluster.local
start kube-apiserver "$C10M_APISERVER_PORT" -- \
  --etcd-servers="http://127.0.0.1:$C10M_ETCD_PORT" \
  --bind-address=127.0.0.1 \
  --secure-port="$C10M_APISERVER_PORT" \
  --advertise-address="$C10M_ADVERTISE_ADDRESS" \
  --tls-cert-file="$PKI/apiserver.crt" \
  --tls-private-key-file="$PKI/apiserver.key" \
  --client-ca-file="$PKI/ca.crt" \
  --token-auth-file="$PKI/tokens.csv" \
  --authorization-mode=Node,RBAC \
  --service-account-issuer="$sa_issuer" \
  --service-account-key-file="$PKI/sa.pub" \
  --service-account-signing-key-file="$PKI/sa.key" \
  --api-audiences="$sa_issuer" \
  --service-cluster-ip-range="$C10M_SERVICE_CIDR" \
  --allow-privileged=true \
  --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
  --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User \
  --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- \
  --proxy-client-cert-file="$PKI/front-proxy-client.crt" \
  --proxy-client-key-file="$PKI/front-proxy-client.key" \
  --kubelet-preferred-address-types=InternalIP \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
  --profiling=false \
  --v=1
wait_healthy kube-apiserver 120
step_done "kube-apiserver ready on https://127.0.0.1:$C10M_APISERVER_PORT"

echo "up: controllers, scheduler, kwok"
# shellcheck disable=SC2086 # the extra args are words
start kube-controller-manager "$C10M_KCM_PORT" -- \
  --kubeconfig="$KUBECONFIGS/kube-controller-manager.kubeconfig" \
  --authentication-kubeconfig="$KUBECONFIGS/kube-controller-manager.kubeconfig" \
  --authorization-kubeconfig="$KUBECONFIGS/kube-controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="$C10M_KCM_PORT" \
  --controllers='*' \
  --service-account-private-key-file="$PKI/sa.key" \
  --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" \
  --cluster-signing-key-file="$PKI/ca.key" \
  --use-service-account-credentials=true \
  --service-cluster-ip-range="$C10M_SERVICE_CIDR" \
  --cluster-name=c10m \
  --flex-volume-plugin-dir="$C10M_STATE/kube-controller-manager/flexvolume" \
  --leader-elect=false \
  --profiling=false \
  $C10M_KCM_EXTRA_ARGS \
  --v=1

# shellcheck disable=SC2086 # the extra args are words
start kube-scheduler "$C10M_SCHEDULER_PORT" -- \
  --kubeconfig="$KUBECONFIGS/kube-scheduler.kubeconfig" \
  --authentication-kubeconfig="$KUBECONFIGS/kube-scheduler.kubeconfig" \
  --authorization-kubeconfig="$KUBECONFIGS/kube-scheduler.kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="$C10M_SCHEDULER_PORT" \
  --leader-elect=false \
  --profiling=false \
  $C10M_SCHEDULER_EXTRA_ARGS \
  --v=1

# kwok reads its stages from a copy of kwok.yaml; its hash is part of the
# recorded command line, so editing kwok.yaml restarts kwok on the next up.
mkdir -p "$C10M_STATE/kwok"
cp "$here/kwok.yaml" "$C10M_STATE/kwok/kwok.yaml.tmp"
mv "$C10M_STATE/kwok/kwok.yaml.tmp" "$C10M_STATE/kwok/kwok.yaml"
# A new kwok process has a new lease holder identity and would wait for the
# previous process's node leases to expire (up to 40 s) before acting as
# those nodes' kubelet. No kwok runs at this point, so drop those leases.
release_node_leases() {
  local nodes
  nodes=$(k get nodes -o jsonpath='{range .items[?(@.metadata.annotations.kwok\.x-k8s\.io/node=="fake")]}{.metadata.name}{" "}{end}') ||
    die "cannot list nodes"
  if [[ -n "${nodes// /}" ]]; then
    # shellcheck disable=SC2086
    k delete lease -n kube-node-lease --ignore-not-found --wait=false $nodes >/dev/null
  fi
}
PRESTART=release_node_leases \
  FINGERPRINT="kwok.yaml sha256 $(sha256sum "$here/kwok.yaml" | cut -c1-16)" \
  start kwok "$C10M_KWOK_PORT" -- \
  --config="$C10M_STATE/kwok/kwok.yaml" \
  --kubeconfig="$KUBECONFIGS/kwok.kubeconfig" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --node-lease-duration-seconds="$C10M_NODE_LEASE_SECONDS" \
  --cidr="$C10M_POD_CIDR_PREFIX.0.0/24" \
  --node-ip="$C10M_NODE_IP_PREFIX.254" \
  --server-address="127.0.0.1:$C10M_KWOK_PORT"

# ---------------------------------------------------------------- nodes
# Node i's pod subnet and InternalIP: $C10M_POD_CIDR_PREFIX.<i>.0/24 and
# $C10M_NODE_IP_PREFIX.<i> up to 255 nodes; past that the octet before
# carries (the scale profile's 500 nodes: 127.2.<i-256>.0/24, and
# 127.0.101.<i-256>). Nothing dials these on the scale plane.
octets_plus() { # A.B[.C] N: REPLY = the address A.B[.C] + N in its last octet, carried
  local IFS=. parts n
  read -ra parts <<<"$1"
  n=$((${#parts[@]} - 1))
  parts[n]=$((parts[n] + ($2 >> 8)))
  REPLY="${parts[*]}.$(($2 & 255))"
}
# node_yaml I: appends node I's manifest to $nodes_manifest (no subshell or
# fork per node: 500 nodes are written in well under a second).
node_yaml() {
  local i=$1 name="kwok-node-$1" zones=(a b c) subnet ip
  octets_plus "$C10M_POD_CIDR_PREFIX" "$i"
  subnet="$REPLY.0/24"
  octets_plus "$C10M_NODE_IP_PREFIX" "$i"
  ip=$REPLY
  nodes_manifest+="---
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: \"0\"
  labels:
    type: kwok
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    node.kubernetes.io/instance-type: c10m-64x256
    topology.kubernetes.io/zone: zone-${zones[$(((i - 1) % 3))]}
    c10m.dev/pool: edge
spec:
  podCIDR: $subnet
  podCIDRs:
  - $subnet
status:
  addresses:
  - type: InternalIP
    address: $ip
  - type: Hostname
    address: $name
  capacity: &resources
    cpu: \"$C10M_NODE_CPU\"
    memory: $C10M_NODE_MEMORY
    pods: \"$C10M_NODE_PODS\"
    ephemeral-storage: 1Ti
  allocatable: *resources
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: $K8S_VERSION
    kubeProxyVersion: \"\"
    containerRuntimeVersion: kwok-$KWOK_VERSION
    kernelVersion: kwok
    osImage: kwok
    machineID: \"\"
    systemUUID: \"\"
    bootID: \"\"
"
}
nodes_manifest=
for ((i = 1; i <= C10M_KWOK_NODES; i++)); do node_yaml "$i"; done
# Create the missing nodes; existing ones are left as they are. Creating a
# Node keeps the status it is created with (capacity, addresses).
existing=$(k get nodes -o name 2>/dev/null) || die "cannot list nodes"
missing=
for ((i = 1; i <= C10M_KWOK_NODES; i++)); do
  [[ $'\n'$existing$'\n' == *$'\n'"node/kwok-node-$i"$'\n'* ]] || missing=1
done
if [[ -n "$missing" ]]; then
  # kubectl creates one object at a time: four at once for the scale
  # profile's 500 nodes (about 25 s in one kubectl, 8 s in four).
  printf '%s' "$nodes_manifest" | awk -v dir="$C10M_STATE/kwok" '
    /^---$/ { n++ } { print > (dir "/nodes-" (n % 4) ".yaml") }'
  creating=()
  for part in 0 1 2 3; do
    [[ -s "$C10M_STATE/kwok/nodes-$part.yaml" ]] || continue
    { k create -f "$C10M_STATE/kwok/nodes-$part.yaml" 2>&1 | grep -v -e 'AlreadyExists' -e ' created$' || true; } &
    creating+=($!)
  done
  # Only these: the components started above are this shell's children too.
  wait "${creating[@]}"
  rm -f "$C10M_STATE"/kwok/nodes-?.yaml
fi
existing=$(k get nodes -o name 2>/dev/null) || die "cannot list nodes"
for ((i = 1; i <= C10M_KWOK_NODES; i++)); do
  [[ $'\n'$existing$'\n' == *$'\n'"node/kwok-node-$i"$'\n'* ]] || die "node kwok-node-$i was not created"
done
step_done "$C10M_KWOK_NODES fake nodes registered"

echo "up: waiting for components"
wait_healthy kube-controller-manager 90
wait_healthy kube-scheduler 90
wait_healthy kwok 90
step_done "kube-controller-manager, kube-scheduler, kwok healthy"

# ---------------------------------------------------------------- readiness
# wait_for DESCRIPTION TIMEOUT COMMAND...: polls COMMAND until it succeeds.
wait_for() {
  local what=$1 timeout=$2 deadline
  shift 2
  deadline=$(($(date +%s) + timeout))
  until "$@"; do
    if (($(date +%s) >= deadline)); then
      echo "error: timed out after $timeout s waiting for $what" >&2
      return 1
    fi
    sleep 0.3
  done
}

# Every node Ready and without taints (TaintNodesByCondition adds
# node.kubernetes.io/not-ready until the node lifecycle controller sees
# Ready), and every KWOK node's lease renewed within its duration
# ($C10M_NODE_LEASE_SECONDS): Ready alone
# may be stale state from the previous run. The real node (label
# c10m.dev/node=real, always tainted) is node.sh's to wait for.
nodes_ready() {
  local out leases name ready taints kwok real renew now
  out=$(k get nodes -o jsonpath='{range .items[*]}{.metadata.name}|{.status.conditions[?(@.type=="Ready")].status}|{.spec.taints}|{.metadata.annotations.kwok\.x-k8s\.io/node}|{.metadata.labels.c10m\.dev/node}{"\n"}{end}' 2>/dev/null) || return 1
  leases=$(k get leases -n kube-node-lease -o jsonpath='{range .items[*]}{.metadata.name}|{.spec.renewTime}{"\n"}{end}' 2>/dev/null) || return 1
  [[ -n "$out" ]] || return 1
  now=$(date +%s)
  while IFS='|' read -r name ready taints kwok real; do
    [[ "$real" == real ]] && continue
    [[ "$ready" == True && -z "$taints" ]] || return 1
    [[ "$kwok" == fake ]] || continue
    renew=$(grep "^$name|" <<<"$leases" | cut -d'|' -f2)
    [[ -n "$renew" ]] && (($(date -d "$renew" +%s) > now - C10M_NODE_LEASE_SECONDS)) || return 1
  done <<<"$out"
}
if ! wait_for "all nodes Ready and untainted" 90 nodes_ready; then
  k get nodes -o wide >&2 || true
  k get nodes -o jsonpath='{range .items[*]}{.metadata.name}: {.spec.taints}{"\n"}{end}' >&2 || true
  log_tail kwok 20
  log_tail kube-controller-manager 20
  exit 1
fi
ready_nodes=$(k get nodes -o jsonpath='{.items[*].metadata.name}')
if (($(wc -w <<<"$ready_nodes") > 10)); then
  step_done "nodes Ready: $(wc -w <<<"$ready_nodes") nodes"
else
  step_done "nodes Ready: $ready_nodes"
fi

sa_exists() { k get serviceaccount default -n default >/dev/null 2>&1; }
if ! wait_for "ServiceAccount default/default" 60 sa_exists; then
  log_tail kube-controller-manager
  exit 1
fi
step_done "ServiceAccount default/default exists"

# ---------------------------------------------------------------- real node
if [[ "$C10M_REAL_NODE" == 0 ]]; then
  if running_pid kubelet >/dev/null; then
    echo "up: real node skipped (C10M_REAL_NODE=0), but its kubelet still runs; $here/node.sh down stops it"
  else
    echo "up: real node skipped (C10M_REAL_NODE=0)"
    # A Node left by an earlier run would look like a real node to tests.
    k delete node "$C10M_NODE_NAME" --ignore-not-found --wait=false >/dev/null
  fi
else
  echo "up: real node $C10M_NODE_NAME (node.sh; C10M_REAL_NODE=0 skips it)"
  C10M_PLANE_BIN=$BIN bash "$here/node.sh" up || die "node.sh up failed; see above (C10M_REAL_NODE=0 skips the real node)"
  t_step=$EPOCHREALTIME
fi

# ---------------------------------------------------------------- smoke test
if [[ -n "$smoke" ]]; then
  echo "up: smoke test"
  k delete pod c10m-smoke --ignore-not-found --wait=true --timeout=30s >/dev/null
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: c10m-smoke
  namespace: default
spec:
  nodeSelector:
    type: kwok
  containers:
  - name: pause
    image: registry.k8s.io/pause:3.10
EOF
  if ! k wait pod/c10m-smoke --for=jsonpath='{.status.phase}'=Running --timeout=60s >/dev/null; then
    k get pod c10m-smoke -o wide >&2 || true
    k describe pod c10m-smoke >&2 || true
    die "smoke pod did not reach Running"
  fi
  step_done "smoke pod Running: $(k get pod c10m-smoke -o jsonpath='node={.spec.nodeName} ip={.status.podIP}')"
  k delete pod c10m-smoke --wait=false >/dev/null
fi

echo "up: plane ready in $(elapsed "$t0") s (state $C10M_STATE, logs $LOGS)"
echo "export KUBECONFIG=$KUBECONFIG_PATH"
