# shellcheck shell=bash disable=SC2034 # settings, used by the scripts that source this
# Settings and helpers shared by up.sh, down.sh and node.sh (sourced, not run).
#
# Every setting can be overridden from the environment. They live here and
# not in env.sh because build.sh keys the binary cache on env.sh: changing
# env.sh would force a rebuild.

cluster_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=env.sh
source "$cluster_dir/env.sh"

# Ports, all bound to 127.0.0.1.
C10M_ETCD_PORT=${C10M_ETCD_PORT:-32379}            # etcd clients (plain http, loopback only)
C10M_ETCD_PEER_PORT=${C10M_ETCD_PEER_PORT:-32380}  # etcd peers
C10M_APISERVER_PORT=${C10M_APISERVER_PORT:-6443}   # kube-apiserver (https)
C10M_KCM_PORT=${C10M_KCM_PORT:-10257}              # kube-controller-manager /healthz (https)
C10M_SCHEDULER_PORT=${C10M_SCHEDULER_PORT:-10259}  # kube-scheduler /healthz (https)
C10M_KWOK_PORT=${C10M_KWOK_PORT:-10247}            # kwok /healthz, /metrics (http)

# Networks.
C10M_SERVICE_CIDR=${C10M_SERVICE_CIDR:-10.96.0.0/16}
# The apiserver must advertise a non-loopback address (the Endpoints of the
# `kubernetes` Service reject 127.0.0.0/8). It is never bound and nothing
# dials it (there is no kube-proxy), so a fixed RFC 5737 documentation
# address keeps the plane independent of the machine's interfaces.
C10M_ADVERTISE_ADDRESS=${C10M_ADVERTISE_ADDRESS:-198.51.100.1}
# Fake nodes: kwok-node-<i> (i = 1..C10M_KWOK_NODES) gets InternalIP
# ${C10M_NODE_IP_PREFIX}.<i> and spec.podCIDR ${C10M_POD_CIDR_PREFIX}.<i>.0/24,
# so pod IPs are 127.1.<i>.1, 127.1.<i>.2, ... (loopback: a test can bind a
# real server to a pod's IP without configuring any interface).
C10M_KWOK_NODES=${C10M_KWOK_NODES:-3}
C10M_NODE_IP_PREFIX=${C10M_NODE_IP_PREFIX:-127.0.100}
C10M_POD_CIDR_PREFIX=${C10M_POD_CIDR_PREFIX:-127.1}
C10M_NODE_CPU=${C10M_NODE_CPU:-64}
C10M_NODE_MEMORY=${C10M_NODE_MEMORY:-256Gi}
C10M_NODE_PODS=${C10M_NODE_PODS:-110}
# KWOK node leases (kwok --node-lease-duration-seconds; renewed every
# quarter of it), and extra flags for kube-controller-manager and
# kube-scheduler (words): the scale profile (scale.env) sets them.
C10M_NODE_LEASE_SECONDS=${C10M_NODE_LEASE_SECONDS:-40}
C10M_KCM_EXTRA_ARGS=${C10M_KCM_EXTRA_ARGS:-}
C10M_SCHEDULER_EXTRA_ARGS=${C10M_SCHEDULER_EXTRA_ARGS:-}

# The real node (node.sh): kubelet + containerd + runc + CNI bridge on this
# host, joined to the plane. C10M_REAL_NODE=0: up.sh leaves it out.
C10M_REAL_NODE=${C10M_REAL_NODE:-1}
C10M_NODE_NAME=${C10M_NODE_NAME:-c10m-real-0}
# Pod subnet of the real node: a private range that exists only on the
# isolated bridge (no uplink, no NAT, no forwarding). The host's address on
# the bridge (the subnet's first address) is the node's InternalIP.
C10M_NODE_POD_CIDR=${C10M_NODE_POD_CIDR:-10.213.95.0/24}
C10M_NODE_BRIDGE=${C10M_NODE_BRIDGE:-c10m0}
C10M_KUBELET_PORT=${C10M_KUBELET_PORT:-20250}                 # kubelet API (https, on the node IP)
C10M_KUBELET_HEALTHZ_PORT=${C10M_KUBELET_HEALTHZ_PORT:-20248} # kubelet /healthz (http, 127.0.0.1)

# Layout of the state directory.
PKI=$C10M_STATE/pki
PIDS=$C10M_STATE/pids
LOGS=$C10M_STATE/logs
KUBECONFIGS=$C10M_STATE/kubeconfigs
NODE_DIR=$C10M_STATE/node
C10M_NODE_CONTAINERD_SOCK=$NODE_DIR/run/containerd/containerd.sock

# Components in start order; down.sh stops them in reverse.
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
# The real node's processes (node.sh; pid files in $PIDS as well).
NODE_COMPONENTS=(containerd kubelet)

die() {
  echo "error: $*" >&2
  exit 1
}

# pid_alive PID: the process exists and is not a zombie.
pid_alive() {
  local state
  [[ "$1" =~ ^[0-9]+$ ]] || return 1
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

# exe_name PID: base name of the process's executable ("etcd", "kwok", ...).
exe_name() {
  local exe
  exe=$(readlink "/proc/$1/exe" 2>/dev/null) || return 1
  exe=${exe% (deleted)}
  echo "${exe##*/}"
}

# running_pid NAME: prints the pid of component NAME if its pid file names a
# live process running that component's binary; fails otherwise.
running_pid() {
  local name=$1 pid
  pid=$(cat "$PIDS/$name.pid" 2>/dev/null) || return 1
  pid_alive "$pid" || return 1
  [[ "$(exe_name "$pid")" == "$name" ]] || return 1
  echo "$pid"
}

# plane_orphans: pids of processes running a cached plane binary with this
# state directory on their command line that no pid file accounts for.
plane_orphans() {
  local p pid exe cmdline name known
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    [[ "$exe" == "$C10M_CACHE/bin/"* ]] || continue
    cmdline=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
    [[ "$cmdline" == *"$C10M_STATE/"* ]] || continue
    known=
    for name in "${COMPONENTS[@]}" "${NODE_COMPONENTS[@]}"; do
      [[ "$(cat "$PIDS/$name.pid" 2>/dev/null)" == "$pid" ]] && known=1
    done
    [[ -z "$known" ]] && echo "$pid"
  done
  return 0
}

# stop_pid LABEL PID: TERM, wait up to 15 s, then KILL.
stop_pid() {
  local label=$1 pid=$2 i
  pid_alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    pid_alive "$pid" || { echo "stopped $label (pid $pid)"; return 0; }
    sleep 0.1
  done
  echo "$label (pid $pid) still running 15 s after TERM; sending KILL" >&2
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    pid_alive "$pid" || { echo "killed $label (pid $pid)"; return 0; }
    sleep 0.1
  done
  die "could not stop $label (pid $pid)"
}

# stop_component NAME: stops it if its pid file names it, removes the pid file.
stop_component() {
  local name=$1 pid
  if pid=$(running_pid "$name"); then
    stop_pid "$name" "$pid"
  fi
  rm -f "$PIDS/$name.pid" "$PIDS/$name.cmd"
}

# launch NAME RECORD COMMAND...: starts COMMAND detached in its own session
# (it outlives the caller and inherits neither lock fd, 8 or 9), logging to
# $LOGS/NAME.log, with its pid in $PIDS/NAME.pid and RECORD (its command
# line and a fingerprint of its inputs) in $PIDS/NAME.cmd, unless NAME
# already runs with the same RECORD and the caller's healthy_NAME succeeds.
# A caller may define strays_NAME to print the pids of untracked NAME
# processes (a pid file lost) to stop first. Returns 0 when it started a
# process, 1 when one was already running.
launch() {
  local name=$1 record=$2 pid
  shift 2
  if pid=$(running_pid "$name"); then
    if [[ "$(cat "$PIDS/$name.cmd" 2>/dev/null)" == "$record" ]] && "healthy_$name"; then
      echo "  $name: already running and healthy (pid $pid)"
      return 1
    fi
    echo "  $name: running (pid $pid) with another configuration, or unhealthy; restarting"
  fi
  stop_component "$name"
  if declare -F "strays_$name" >/dev/null; then
    for pid in $("strays_$name"); do stop_pid "untracked $name" "$pid"; done
  fi
  {
    echo
    echo "==== $(date -u +%FT%TZ) ${0##*/} starting $name"
    echo "==== $*"
  } >>"$LOGS/$name.log"
  setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 8>&- 9>&- &
  pid=$!
  echo "$pid" >"$PIDS/$name.pid"
  printf '%s' "$record" >"$PIDS/$name.cmd"
  echo "  $name: started (pid $pid, log $LOGS/$name.log)"
}

# wait_healthy NAME SECONDS [quiet]: polls the caller's healthy_NAME until it
# succeeds. If NAME's process (its pid file in $PIDS) exits, or SECONDS
# pass: returns 1 when quiet, else prints the end of its log and dies.
wait_healthy() {
  local name=$1 timeout=$2 quiet=${3:-} deadline pid why
  deadline=$(($(date +%s) + timeout))
  until "healthy_$name"; do
    pid=$(cat "$PIDS/$name.pid" 2>/dev/null || true)
    why=
    if ! pid_alive "$pid"; then
      why="exited during startup"
    elif (($(date +%s) >= deadline)); then
      why="not healthy after $timeout s"
    fi
    if [[ -n "$why" ]]; then
      [[ -n "$quiet" ]] && return 1
      log_tail "$name"
      die "$name (pid $pid) $why"
    fi
    sleep 0.2
  done
}

# log_tail NAME [LINES]: the end of a component's log, for error messages.
log_tail() {
  local log="$LOGS/$1.log"
  if [[ -s "$log" ]]; then
    echo "---- last ${2:-40} lines of $log ----" >&2
    tail -n "${2:-40}" "$log" >&2
    echo "----" >&2
  else
    echo "($log is empty or missing)" >&2
  fi
}

# Lock serialising up.sh and down.sh. The fd must not leak into daemons.
take_lock() {
  mkdir -p "$C10M_STATE"
  exec 9>"$C10M_STATE/.lock"
  if ! flock -w 600 9; then
    die "another up.sh/down.sh holds $C10M_STATE/.lock for over 10 minutes"
  fi
}

# ---------------------------------------------------------------- addresses
# ip4_add ADDRESS N: the IPv4 address N after ADDRESS.
ip4_add() {
  local a b c d n
  IFS=. read -r a b c d <<<"$1"
  n=$(((a << 24 | b << 16 | c << 8 | d) + $2))
  echo "$((n >> 24 & 255)).$((n >> 16 & 255)).$((n >> 8 & 255)).$((n & 255))"
}

# ---------------------------------------------------------------- PKI
# new_cert DIR CA NAME SUBJECT EXTENSIONS: DIR/NAME.{key,crt} signed by DIR/CA.
new_cert() {
  local dir=$1 ca=$2 name=$3 subj=$4 ext=$5
  openssl genrsa -out "$dir/$name.key" 2048 2>/dev/null
  openssl req -new -key "$dir/$name.key" -subj "$subj" -out "$dir/$name.csr" 2>/dev/null
  printf '[ext]\n%s\n' "$ext" >"$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/$ca.crt" -CAkey "$dir/$ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 3650 -sha256 \
    -extfile "$dir/$name.ext" -extensions ext -out "$dir/$name.crt" 2>/dev/null
  rm -f "$dir/$name.csr" "$dir/$name.ext"
}

# new_ca DIR NAME CN: self-signed CA DIR/NAME.{key,crt}.
new_ca() {
  local dir=$1 name=$2 cn=$3
  printf '[req]\ndistinguished_name=dn\nx509_extensions=ca\n[dn]\n[ca]\n%s\n' \
    "basicConstraints=critical,CA:TRUE
keyUsage=critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier=hash" >"$dir/$name.cnf"
  openssl genrsa -out "$dir/$name.key" 2048 2>/dev/null
  openssl req -x509 -new -key "$dir/$name.key" -config "$dir/$name.cnf" -subj "/CN=$cn" \
    -days 3650 -sha256 -out "$dir/$name.crt" 2>/dev/null
  rm -f "$dir/$name.cnf"
}

# Extensions of a client certificate (new_cert's EXTENSIONS).
# shellcheck disable=SC2034 # used by up.sh and node.sh
client_ext="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
authorityKeyIdentifier=keyid"

# write_kubeconfig FILE USER CERT-NAME: kubeconfig for the plane's apiserver
# with the client cert $PKI/CERT-NAME.{crt,key} embedded; FILE is replaced
# only when its content changes.
write_kubeconfig() {
  local file=$1 user=$2 cert=$3
  cat >"$file.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: c10m
  cluster:
    server: https://127.0.0.1:$C10M_APISERVER_PORT
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$cert.crt")
    client-key-data: $(base64 -w0 "$PKI/$cert.key")
contexts:
- name: c10m
  context:
    cluster: c10m
    user: $user
    namespace: default
current-context: c10m
EOF
  chmod 600 "$file.tmp"
  if cmp -s "$file.tmp" "$file"; then rm -f "$file.tmp"; else mv "$file.tmp" "$file"; fi
}
