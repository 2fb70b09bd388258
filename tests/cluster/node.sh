#!/usr/bin/env bash
# The local plane's real node: containerd + runc + a CNI bridge + a kubelet
# registered with the plane's apiserver as $C10M_NODE_NAME (c10m-real-0).
# Labelled c10m.dev/node=real and tainted c10m.dev/real-node=true:NoSchedule,
# so only pods that tolerate the taint land there. Runs as root; everything
# lives under $C10M_STATE/node (see README.md, "The real node").
#
#   node.sh up             start (or check) it: bridge, containerd, images,
#                          kubelet; waits until the node is Ready (idempotent)
#   node.sh down           delete its pods, stop everything and leave the host
#                          as it was before `up` (idempotent)
#   node.sh status         processes, node, pods, containers
#   node.sh import FILE... import image archives (OCI or docker-archive) into
#                          containerd's k8s.io namespace
#   node.sh env            shell assignments for tests: eval "$(node.sh env)"
#   node.sh ctr ARGS...    ctr against the node's containerd, namespace k8s.io
set -euo pipefail
export LC_ALL=C
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"

SOCK=$C10M_NODE_CONTAINERD_SOCK
NODE_IP=$(ip4_add "${C10M_NODE_POD_CIDR%/*}" 1)
KROOT=$NODE_DIR/kubelet              # kubelet --root-dir (a shared mount)
RUN=$NODE_DIR/run                    # like /run: emptied by down
ETC=$NODE_DIR/etc                    # rendered configs
POD_LOGS=$NODE_DIR/pod-logs
HOST_CREATED=$NODE_DIR/host-created  # host paths that did not exist before up
KUBE_CHAINS_BEFORE=$NODE_DIR/kube-chains-before
FACTS=$NODE_DIR/facts
IMPORTED=$NODE_DIR/imported          # stamps of imported archives
# Host paths the kubelet and containerd create outside $NODE_DIR whatever
# their configuration says: the kubelet's device-plugin socket
# (/var/lib/kubelet/device-plugins/kubelet.sock), its log symlinks
# (/var/log/containers/), containerd 1.6's shim sockets (/run/containerd/s/)
# and libcni's result cache (/var/lib/cni/results/<network>-<id>-<if>).
# host-state.sh also lists other default paths (/var/log/pods, ...) that
# nothing creates here.
HOST_PATHS=(/var/lib/kubelet /var/log/containers /run/containerd /run/containerd/s
  /var/lib/cni /var/lib/cni/results)
CRI_ROOT=$NODE_DIR/containerd/root/io.containerd.grpc.v1.cri
LABEL_NODE=c10m.dev/node
LABEL_NOFILE=c10m.dev/nofile-hard-limit
LABEL_SYS_RESOURCE=c10m.dev/sys-resource
LABEL_HOST_NETNS=c10m.dev/host-network-namespace
LABEL_CGROUP=c10m.dev/cgroup-mode
TAINT=c10m.dev/real-node=true:NoSchedule
# The kubelet's allowedUnsafeSysctls (node/kubelet-config.yaml), stated on
# the Node in this annotation, which the operator reads: the API shows no
# kubelet configuration.
ANNOTATION_UNSAFE_SYSCTLS=c10m.dev/allowed-unsafe-sysctls
ALLOWED_UNSAFE_SYSCTLS=net.core.somaxconn

k() { kubectl --kubeconfig "$KUBECONFIG_PATH" --request-timeout=10s "$@"; }
ctr_() { ctr -a "$SOCK" -n k8s.io "$@"; }
warn() { echo "node: warning: $*" >&2; }

t0=$EPOCHREALTIME
t_step=$t0
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
step_done() {
  echo "  [$(elapsed "$t_step") s] $1"
  t_step=$EPOCHREALTIME
}

# Serialises node.sh runs (up.sh holds the plane's lock on fd 9 meanwhile).
node_lock() {
  mkdir -p "$NODE_DIR"
  exec 8>"$NODE_DIR/.lock"
  flock -w 600 8 || die "another node.sh holds $NODE_DIR/.lock for over 10 minutes"
}

api_up() { k get --raw /readyz >/dev/null 2>&1; }

# ---------------------------------------------------------------- addresses
ip4_int() {
  local a b c d
  IFS=. read -r a b c d <<<"$1"
  echo $((a << 24 | b << 16 | c << 8 | d))
}

# overlaps CIDR1 CIDR2: the two IPv4 prefixes share an address.
overlaps() {
  local a=${1%/*} la=${1#*/} b=${2%/*} lb=${2#*/} l mask
  [[ "$1" == */* ]] || la=32
  [[ "$2" == */* ]] || lb=32
  l=$((la < lb ? la : lb))
  mask=$(((0xffffffff << (32 - l)) & 0xffffffff))
  ((($(ip4_int "$a") & mask) == ($(ip4_int "$b") & mask)))
}

check_cidr() {
  local cidr=$C10M_NODE_POD_CIDR net len n dev dst
  [[ "$cidr" =~ ^([0-9]{1,3}\.){3}[0-9]{1,3}/([0-9]{1,2})$ ]] || die "C10M_NODE_POD_CIDR=$cidr is not an IPv4 CIDR"
  net=${cidr%/*} len=${cidr#*/}
  ((len >= 16 && len <= 29)) || die "C10M_NODE_POD_CIDR=$cidr: use a prefix length from /16 to /29"
  n=$(ip4_int "$net")
  ((n == (n & ((0xffffffff << (32 - len)) & 0xffffffff)))) || die "C10M_NODE_POD_CIDR=$cidr is not a network address"
  overlaps "$cidr" 10.0.0.0/8 || overlaps "$cidr" 172.16.0.0/12 || overlaps "$cidr" 192.168.0.0/16 ||
    die "C10M_NODE_POD_CIDR=$cidr is not a private (RFC 1918) range"
  # No other interface or route may use any part of it: the subnet must
  # exist only on the isolated bridge.
  while read -r _ dev _ dst _; do
    [[ "$dev" == "$C10M_NODE_BRIDGE" ]] && continue
    if overlaps "$cidr" "$dst"; then
      die "C10M_NODE_POD_CIDR=$cidr overlaps $dst on $dev; choose another private range (and down.sh --purge)"
    fi
  done < <(ip -o -4 addr show)
  while read -r dst dev; do
    [[ "$dev" == "$C10M_NODE_BRIDGE" || "$dst" == default ]] && continue
    if overlaps "$cidr" "$dst"; then
      die "C10M_NODE_POD_CIDR=$cidr overlaps the route to $dst via $dev; choose another private range"
    fi
  done < <(ip -4 route show table all | awk '$1 ~ /^(local|broadcast|unreachable|blackhole|prohibit|throw)$/ { next }
    { for (i = 2; i < NF; i++) if ($i == "dev") print $1, $(i + 1) }')
}

# ---------------------------------------------------------------- processes
# pids_where EXE-BASENAME STRING: live processes running EXE-BASENAME whose
# command line contains STRING (ours: STRING is one of our paths).
pids_where() {
  local exe pid
  while IFS= read -r exe; do
    pid=${exe#/proc/}
    pid=${pid%/exe}
    [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == *"$2"* ]] || continue
    pid_alive "$pid" && echo "$pid"
  done < <(find /proc -mindepth 2 -maxdepth 2 -name exe \( -lname "*/$1" -o -lname "*/$1 (deleted)" \) 2>/dev/null)
  return 0
}

# For launch (lib.sh): health checks, and processes of this node left
# without a pid file.
healthy_containerd() { timeout 5 ctr -a "$SOCK" version >/dev/null 2>&1; }
strays_containerd() { pids_where containerd "$NODE_DIR/"; }
strays_kubelet() { pids_where kubelet "$NODE_DIR/"; }
healthy_kubelet() { [[ "$(curl -fsS --noproxy '*' --max-time 2 "http://127.0.0.1:$C10M_KUBELET_HEALTHZ_PORT/healthz" 2>/dev/null)" == ok ]]; }

# ---------------------------------------------------------------- images
# normalized NAME: the name CRI resolves an image reference to
# (c10m/server:0.1.0 -> docker.io/c10m/server:0.1.0).
normalized() {
  local name=$1 first=${1%%/*}
  if [[ "$name" != */* ]]; then
    echo "docker.io/library/$name"
  elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then
    echo "$name"
  else
    echo "docker.io/$name"
  fi
}

# import_archive FILE: imports FILE unless the same file (path, size, mtime)
# was imported and its images are still there. Image names without a
# registry get their docker.io name too, and localhost/NAME gets
# docker.io/NAME (buildah names local images localhost/...), so that a pod's
# `image: NAME` finds them.
import_archive() {
  local file=$1 stamp_file id out names name alias all
  [[ -f "$file" ]] || die "no such image archive: $file"
  file=$(realpath "$file")
  mkdir -p "$IMPORTED"
  stamp_file=$IMPORTED/$(sha256sum <<<"$file" | cut -c1-16)
  id="$file $(stat -c '%s %Y' "$file")"
  all=$(ctr_ images ls -q) || die "cannot list images in $SOCK"
  if [[ -f "$stamp_file" && "$(head -n1 "$stamp_file")" == "$id" ]]; then
    names=$(tail -n +2 "$stamp_file")
    local missing=
    for name in $names; do grep -qxF "$name" <<<"$all" || missing=1; done
    if [[ -n "$names" && -z "$missing" ]]; then
      echo "  image $(echo "$names" | head -n1) from ${file##*/}: already imported"
      return 0
    fi
  fi
  out=$(ctr_ images import "$file" 2>&1) || {
    echo "$out" >&2
    die "importing $file failed"
  }
  names=$(sed -n 's/^unpacking \(.*\) (sha256:[0-9a-f]*).*$/\1/p' <<<"$out")
  [[ -n "$names" ]] || {
    echo "$out" >&2
    die "$file holds no named image (ctr images import printed no 'unpacking NAME')"
  }
  local aliases=
  for name in $names; do
    alias=$(normalized "$name")
    [[ "$alias" == localhost/* ]] && alias=docker.io/${alias#localhost/}
    if [[ "$alias" != "$name" ]]; then
      ctr_ images tag --force "$name" "$alias" >/dev/null
      aliases+="$alias"$'\n'
    fi
  done
  printf '%s\n%s\n%s' "$id" "$names" "$aliases" >"$stamp_file"
  echo "  imported $(printf '%s\n%s' "$names" "$aliases" | xargs) from ${file##*/}"
}

# ---------------------------------------------------------------- facts
# Probes of what containers on this node can get (node labels the operator
# reads); written to $FACTS.
probe_facts() {
  local pid=$1 nofile capbnd sys=available netns=available
  nofile=$(awk '/^Max open files/ { print $5 }' "/proc/$pid/limits")
  [[ -n "$nofile" ]] || die "cannot read containerd's RLIMIT_NOFILE"
  # CAP_SYS_RESOURCE is bit 24; runc cannot add a capability that is not
  # in containerd's bounding set.
  capbnd=$(awk '/^CapBnd:/ { print $2 }' "/proc/$pid/status")
  (((0x$capbnd >> 24) & 1)) || sys=unavailable
  # The init container enters the host's network namespace through
  # /proc/1/ns/net; some hosts refuse even root (ptrace access check).
  (exec 3</proc/1/ns/net) 2>/dev/null || netns=unavailable
  # What a connection charges to its pod follows the cgroup version the
  # kubelet runs pods under (cgroupfs driver: the host's hierarchy).
  local cgroup=v1
  [[ "$(stat -fc %T /sys/fs/cgroup)" == cgroup2fs ]] && cgroup=v2
  printf 'nofile_hard=%s\nsys_resource=%s\nhost_network_namespace=%s\ncgroup_mode=%s\n' "$nofile" "$sys" "$netns" "$cgroup" >"$FACTS"
}
fact() { sed -n "s/^$1=//p" "$FACTS"; }

node_labels() { # comma-separated, for --node-labels
  local l
  l="$LABEL_NODE=real,$LABEL_NOFILE=$(fact nofile_hard),$LABEL_CGROUP=$(fact cgroup_mode)"
  [[ "$(fact sys_resource)" == unavailable ]] && l+=",$LABEL_SYS_RESOURCE=unavailable"
  [[ "$(fact host_network_namespace)" == unavailable ]] && l+=",$LABEL_HOST_NETNS=unavailable"
  echo "$l"
}

# ---------------------------------------------------------------- host state
# kube_chains: "<iptables|ip6tables> <table> <chain>" for every KUBE-* chain.
kube_chains() {
  local cmd
  for cmd in iptables ip6tables; do
    command -v "$cmd-save" >/dev/null || continue
    "$cmd-save" 2>/dev/null | awk -v c="$cmd" '/^\*/ { t = substr($0, 2) } /^:KUBE-/ { print c, t, substr($1, 2) }'
  done
  return 0
}

# mounts_under DIR: mount points at or below DIR, deepest first.
mounts_under() {
  awk -v d="$1" '{ m = $5; gsub(/\\040/, " ", m); if (m == d || index(m, d "/") == 1) print length(m) "\t" m }' \
    /proc/self/mountinfo | sort -rn | cut -f2-
}

cgroup_mounts() { awk '$3 == "cgroup" || $3 == "cgroup2" { print $2 }' /proc/self/mounts; }

# Host paths that do not exist yet are recorded before anything starts, so
# that down removes exactly those (and nothing that was there before).
record_host_state() {
  local p
  touch "$HOST_CREATED"
  for p in "${HOST_PATHS[@]}"; do
    [[ -e "$p" ]] && continue
    grep -qxF "$p" "$HOST_CREATED" || echo "$p" >>"$HOST_CREATED"
  done
  [[ -f "$KUBE_CHAINS_BEFORE" ]] || kube_chains >"$KUBE_CHAINS_BEFORE"
}

preflight() {
  local c p
  ((EUID == 0)) || die "node.sh needs root (containerd, kubelet, mounts, bridge)"
  for c in containerd containerd-shim-runc-v2 runc ctr ip unshare mount umount mountpoint setsid curl kubectl openssl flock; do
    command -v "$c" >/dev/null || die "$c not found; run $here/install-deps.sh"
  done
  if [[ -z "${C10M_CNI_BIN_DIR:-}" ]]; then
    for C10M_CNI_BIN_DIR in /usr/lib/cni /opt/cni/bin; do
      [[ -x "$C10M_CNI_BIN_DIR/bridge" ]] && break
    done
  fi
  for p in bridge host-local loopback; do
    [[ -x "$C10M_CNI_BIN_DIR/$p" ]] || die "CNI plugin $p not in $C10M_CNI_BIN_DIR; run $here/install-deps.sh (containernetworking-plugins)"
  done
  ((${#SOCK} < 100)) || die "containerd socket path $SOCK is too long for a unix socket; use a shorter C10M_STATE"
  [[ -n "$(cgroup_mounts)" ]] || die "no cgroup hierarchy is mounted"
  # Another kubelet on this host would share /var/lib/kubelet and /kubepods.
  for p in $(pids_where kubelet ""); do
    [[ "$(tr '\0' ' ' <"/proc/$p/cmdline")" == *"$NODE_DIR/"* ]] ||
      die "another kubelet runs on this host (pid $p); the real node cannot share it"
  done
  if [[ -e /var/lib/kubelet ]] && ! grep -qxF /var/lib/kubelet "$HOST_CREATED" 2>/dev/null; then
    die "/var/lib/kubelet exists and was not created by node.sh (a kubelet installed on this host?); remove it if nothing uses it"
  fi
}

# ---------------------------------------------------------------- up
render() { # TEMPLATE OUT: substitutes the @NAME@ placeholders
  local s
  s=$(<"$1")
  s=${s//@NODE_DIR@/"$NODE_DIR"}
  s=${s//@SOCK@/"$SOCK"}
  s=${s//@PAUSE_IMAGE@/"$C10M_PAUSE_IMAGE"}
  s=${s//@RUNC@/"$(command -v runc)"}
  s=${s//@CNI_BIN_DIR@/"$C10M_CNI_BIN_DIR"}
  s=${s//@BRIDGE@/"$C10M_NODE_BRIDGE"}
  s=${s//@POD_CIDR@/"$C10M_NODE_POD_CIDR"}
  s=${s//@NODE_IP@/"$NODE_IP"}
  s=${s//@KUBELET_PORT@/"$C10M_KUBELET_PORT"}
  s=${s//@HEALTHZ_PORT@/"$C10M_KUBELET_HEALTHZ_PORT"}
  s=${s//@PKI@/"$PKI"}
  s=${s//@ALLOWED_UNSAFE_SYSCTLS@/"$ALLOWED_UNSAFE_SYSCTLS"}
  [[ "$s" != *@[A-Z_]*@* ]] || die "unrendered placeholder in $1"
  printf '%s\n' "$s" >"$2.tmp"
  if cmp -s "$2.tmp" "$2"; then rm -f "$2.tmp"; else mv "$2.tmp" "$2"; fi
}

ensure_bridge() {
  local len=${C10M_NODE_POD_CIDR#*/} have
  if ip link show "$C10M_NODE_BRIDGE" >/dev/null 2>&1; then
    have=$(ip -o -4 addr show dev "$C10M_NODE_BRIDGE" | awk '{ print $4 }')
    if [[ "$have" == "$NODE_IP/$len" ]]; then
      ip link set "$C10M_NODE_BRIDGE" up
      return 0
    fi
    echo "  bridge $C10M_NODE_BRIDGE has address '${have:-none}', not $NODE_IP/$len; recreating it"
    ip link del "$C10M_NODE_BRIDGE"
  fi
  # The host's address on the bridge is the pods' only peer: the CNI bridge
  # plugin runs with isGateway false (so it never turns on ip_forward),
  # without NAT and without routes.
  ip link add name "$C10M_NODE_BRIDGE" type bridge
  ip addr add "$NODE_IP/$len" dev "$C10M_NODE_BRIDGE"
  ip link set "$C10M_NODE_BRIDGE" up
}

# The kubelet's root dir is a shared bind mount of itself: volumes the
# kubelet mounts there from its own mount namespace reach the host's
# namespace (containerd's).
ensure_kubelet_root() {
  mkdir -p "$KROOT"
  if ! mountpoint -q "$KROOT"; then
    mount --bind "$KROOT" "$KROOT"
  fi
  mount --make-shared "$KROOT"
}

ensure_node_cert() {
  local name=node-$C10M_NODE_NAME
  if [[ ! -f "$PKI/$name.crt" ]] || ! openssl verify -CAfile "$PKI/ca.crt" "$PKI/$name.crt" >/dev/null 2>&1; then
    new_cert "$PKI" ca "$name" "/O=system:nodes/CN=system:node:$C10M_NODE_NAME" "$client_ext"
    chmod 600 "$PKI/$name.key"
  fi
  write_kubeconfig "$KUBECONFIGS/kubelet.kubeconfig" "system:node:$C10M_NODE_NAME" "$name"
}

node_field() { k get node "$C10M_NODE_NAME" -o jsonpath="$1" 2>/dev/null; }
# Ready, and no taint but ours (the node lifecycle controller removes
# node.kubernetes.io/not-ready a few seconds after Ready).
node_schedulable() {
  local out
  out=$(node_field '{.status.conditions[?(@.type=="Ready")].status}|{range .spec.taints[*]}{.key}{" "}{end}') || return 1
  [[ "$out" == "True|${TAINT%%=*} " ]]
}

wait_until() { # DESCRIPTION TIMEOUT COMMAND...
  local what=$1 timeout=$2 deadline=$(($(date +%s) + $2))
  shift 2
  until "$@"; do
    (($(date +%s) < deadline)) || {
      echo "error: timed out after $timeout s waiting for $what" >&2
      return 1
    }
    sleep 0.2
  done
}

up() {
  local bin pid record f nofile labels
  preflight
  api_up || die "the plane's apiserver is not reachable; run $here/up.sh"
  bin=${C10M_PLANE_BIN:-}
  if [[ ! -x "$bin/kubelet" ]]; then
    mkdir -p "$C10M_CACHE"
    bin=$(flock -w 3600 "$C10M_CACHE/.build.lock" "$here/build.sh" | tail -n1) || die "build.sh failed"
  fi
  [[ -x "$bin/kubelet" && -s "$bin/pause-image.tar" ]] || die "no kubelet or pause image in $bin"
  node_lock
  check_cidr
  mkdir -p "$PIDS" "$LOGS" "$KUBECONFIGS" "$ETC/cni/net.d" "$RUN/containerd" "$RUN/sysctl" "$POD_LOGS"
  record_host_state
  step_done "preflight (pod CIDR $C10M_NODE_POD_CIDR, node IP $NODE_IP)"

  ensure_bridge
  render "$here/node/containerd.toml" "$ETC/containerd.toml"
  render "$here/node/cni.conflist" "$ETC/cni/net.d/10-c10m.conflist"
  render "$here/node/kubelet-config.yaml" "$ETC/kubelet-config.yaml"
  ensure_node_cert
  step_done "bridge $C10M_NODE_BRIDGE ($NODE_IP/${C10M_NODE_POD_CIDR#*/}), configs, node certificate"

  # Pulls never leave the machine: containerd's CRI registry client goes
  # through http.ProxyFromEnvironment, so with every proxy set to a dead
  # loopback port (discard, 9/tcp: nothing listens) a pull of an image the
  # node lacks fails at once with "proxyconnect tcp: dial tcp 127.0.0.1:9:
  # connect: connection refused", before any DNS lookup of the registry
  # host (the proxy would resolve it). Images reach the node only through
  # import_archive below (`make images`).
  local proxy=http://127.0.0.1:9
  record="$(command -v containerd) --config $ETC/containerd.toml proxy=$proxy # $(sha256sum <"$ETC/containerd.toml" | cut -c1-16)"
  launch containerd "$record" env HTTP_PROXY="$proxy" HTTPS_PROXY="$proxy" NO_PROXY= \
    http_proxy="$proxy" https_proxy="$proxy" no_proxy= "$(command -v containerd)" --config "$ETC/containerd.toml" ||
    true # already running
  wait_healthy containerd 30
  pid=$(running_pid containerd)
  step_done "containerd $(containerd --version | awk '{ print $3 }') ready (socket $SOCK)"

  import_archive "$bin/pause-image.tar"
  for f in "$C10M_CACHE"/images/*.tar; do
    [[ -f "$f" ]] && import_archive "$f"
  done
  step_done "images"

  probe_facts "$pid"
  nofile=$(fact nofile_hard)
  labels=$(node_labels)
  echo "  facts: hard nofile $nofile, CAP_SYS_RESOURCE $(fact sys_resource), host netns $(fact host_network_namespace)"

  ensure_kubelet_root
  # The CPU manager's checkpoint may still assign CPUs to containers that
  # no longer exist (a pod deleted shortly before the kubelet stopped). A
  # kubelet admits pods before it drops such stale entries, so a
  # Guaranteed pod created right after start would fail with
  # UnexpectedAdmissionError. With no container left, no entry is valid.
  if ! running_pid kubelet >/dev/null && [[ -z "$(ctr_ containers ls -q)" ]]; then
    rm -f "$KROOT/cpu_manager_state" "$KROOT/memory_manager_state"
  fi
  local cmd=(unshare -m --propagation unchanged "$here/node/kubelet-ns.sh" "$RUN/sysctl"
    "$bin/kubelet" --config="$ETC/kubelet-config.yaml" --kubeconfig="$KUBECONFIGS/kubelet.kubeconfig"
    --root-dir="$KROOT" --cert-dir="$NODE_DIR/kubelet-pki" --hostname-override="$C10M_NODE_NAME"
    --node-ip="$NODE_IP" --node-labels="$labels" --v="${C10M_KUBELET_V:-1}")
  record="$(printf '%q ' "${cmd[@]}")# $(cat "$ETC/kubelet-config.yaml" "$KUBECONFIGS/kubelet.kubeconfig" \
    "$here/node/kubelet-ns.sh" | sha256sum | cut -c1-16)"
  launch kubelet "$record" "${cmd[@]}" || true # already running
  wait_healthy kubelet 60
  step_done "kubelet healthy (http://127.0.0.1:$C10M_KUBELET_HEALTHZ_PORT/healthz)"

  wait_until "node $C10M_NODE_NAME to register" 60 node_field '{.metadata.name}' >/dev/null || {
    log_tail kubelet
    exit 1
  }
  # --node-labels and registerWithTaints apply only when the kubelet creates
  # the Node; an existing one (state kept by down.sh) is brought up to date.
  local set=("$LABEL_NODE=real" "$LABEL_NOFILE=$nofile" "$LABEL_CGROUP=$(fact cgroup_mode)")
  if [[ "$(fact sys_resource)" == unavailable ]]; then set+=("$LABEL_SYS_RESOURCE=unavailable"); else set+=("$LABEL_SYS_RESOURCE-"); fi
  if [[ "$(fact host_network_namespace)" == unavailable ]]; then set+=("$LABEL_HOST_NETNS=unavailable"); else set+=("$LABEL_HOST_NETNS-"); fi
  k label node "$C10M_NODE_NAME" --overwrite "${set[@]}" >/dev/null 2>&1 || die "cannot label node $C10M_NODE_NAME"
  k annotate node "$C10M_NODE_NAME" --overwrite "$ANNOTATION_UNSAFE_SYSCTLS=$ALLOWED_UNSAFE_SYSCTLS" >/dev/null ||
    die "cannot annotate node $C10M_NODE_NAME"
  k taint node "$C10M_NODE_NAME" "$TAINT" --overwrite >/dev/null || die "cannot taint node $C10M_NODE_NAME"
  k uncordon "$C10M_NODE_NAME" >/dev/null || die "cannot uncordon node $C10M_NODE_NAME"
  if ! wait_until "node $C10M_NODE_NAME Ready" 90 node_schedulable; then
    k get node "$C10M_NODE_NAME" -o wide >&2 || true
    node_field '{.spec.taints}{"\n"}{range .status.conditions[*]}{.type}={.status} {.message}{"\n"}{end}' >&2 || true
    log_tail kubelet
    exit 1
  fi
  step_done "node $C10M_NODE_NAME Ready ($labels; taint $TAINT)"
  echo "node: up in $(elapsed "$t0") s (containerd $SOCK, logs $LOGS/{containerd,kubelet}.log)"
}

# ---------------------------------------------------------------- down
# delete_pods: deletes the pods bound to the node through the apiserver and
# waits for the kubelet to stop them (grace periods honoured), up to
# $C10M_NODE_DRAIN_TIMEOUT s (default 60); then removes what is left.
delete_pods() {
  local timeout=${C10M_NODE_DRAIN_TIMEOUT:-60} sel="spec.nodeName=$C10M_NODE_NAME" deadline left
  k cordon "$C10M_NODE_NAME" >/dev/null 2>&1 || true
  left=$(k get pods -A --field-selector "$sel" -o name 2>/dev/null | wc -l)
  ((left > 0)) || return 0
  echo "  deleting $left pod(s) on $C10M_NODE_NAME"
  k delete pods -A --field-selector "$sel" --wait=false >/dev/null 2>&1 || true
  if running_pid kubelet >/dev/null; then
    deadline=$(($(date +%s) + timeout))
    while (($(date +%s) < deadline)); do
      left=$(k get pods -A --field-selector "$sel" -o name 2>/dev/null | wc -l)
      ((left == 0)) && return 0
      sleep 0.2
    done
    warn "$left pod(s) still on $C10M_NODE_NAME after $timeout s; removing them"
  fi
  k delete pods -A --field-selector "$sel" --grace-period=0 --force >/dev/null 2>&1 || true
}

# kill_cgroup_procs: SIGKILL every process left in the pods' cgroups.
kill_cgroup_procs() {
  local m f pids i
  for ((i = 0; i < 50; i++)); do
    pids=
    for m in $(cgroup_mounts); do
      [[ -d "$m/kubepods" ]] || continue
      while IFS= read -r -d '' f; do
        pids+=" $(tr '\n' ' ' <"$f")"
      done < <(find "$m/kubepods" -name cgroup.procs -print0 2>/dev/null)
    done
    [[ -n "${pids// /}" ]] || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  warn "processes left in the kubepods cgroups:$pids"
}

remove_cgroups() {
  local m i ok
  for ((i = 0; i < 50; i++)); do
    ok=1
    for m in $(cgroup_mounts); do
      [[ -d "$m/kubepods" ]] || continue
      find "$m/kubepods" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ -d "$m/kubepods" ]] && ok=
    done
    [[ -n "$ok" ]] && return 0
    sleep 0.1
  done
  warn "could not remove the kubepods cgroups: $(for m in $(cgroup_mounts); do [[ -d "$m/kubepods" ]] && echo -n "$m/kubepods "; done)"
  return 1
}

unmount_all() {
  local m i left
  for ((i = 0; i < 3; i++)); do
    while IFS= read -r m; do
      [[ -n "$m" ]] || continue
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done < <(mounts_under "$NODE_DIR")
    left=$(mounts_under "$NODE_DIR")
    [[ -z "$left" ]] && return 0
  done
  warn "still mounted: $left"
  return 1
}

# remove_leftovers ID...: what our containers (IDs) left in host directories
# that other runtimes may share. /run/containerd/s: containerd 1.6 names a
# shim's socket sha256(<containerd's grpc address>/<namespace>/<sandbox
# id>), and a shim killed before its task was deleted leaves it behind.
# /var/lib/cni/results: libcni caches each sandbox's result as
# <network>-<sandbox id>-<interface> until the CNI DEL, which a sandbox
# killed without the kubelet never gets.
remove_leftovers() {
  local id hex
  for id in "$@"; do
    [[ "$id" =~ ^[0-9a-f]{64}$ ]] || continue
    hex=$(printf '%s' "$SOCK/k8s.io/$id" | sha256sum | cut -d' ' -f1)
    rm -f "/run/containerd/s/$hex" /var/lib/cni/results/*-"$id"-*
  done
}

remove_kube_chains() {
  local cmd table chain line
  local -a new=()
  while read -r cmd table chain; do
    grep -qxF "$cmd $table $chain" "$KUBE_CHAINS_BEFORE" 2>/dev/null || new+=("$cmd $table $chain")
  done < <(kube_chains)
  ((${#new[@]})) || return 0
  echo "  removing iptables chains: ${new[*]}"
  for line in "${new[@]}"; do
    read -r cmd table chain <<<"$line"
    # rules in other chains that jump to this one
    "$cmd" -t "$table" -S | awk -v c="$chain" '$1 == "-A" && $2 != c && / -j / { for (i = 3; i < NF; i++) if ($i == "-j" && $(i + 1) == c) { print; next } }' |
      while read -r rule; do
        eval "\"\$cmd\" -t \"\$table\" -D ${rule#-A }" || true
      done
  done
  for line in "${new[@]}"; do
    read -r cmd table chain <<<"$line"
    "$cmd" -t "$table" -F "$chain" || true
  done
  for line in "${new[@]}"; do
    read -r cmd table chain <<<"$line"
    "$cmd" -t "$table" -X "$chain" || true
  done
}

down() {
  local pid ids rc=0 p i
  if [[ ! -d "$NODE_DIR" ]]; then
    echo "node: nothing to do ($NODE_DIR does not exist)"
    return 0
  fi
  ((EUID == 0)) || die "node.sh down needs root"
  node_lock
  if api_up && k get node "$C10M_NODE_NAME" >/dev/null 2>&1; then
    delete_pods
    step_done "pods on $C10M_NODE_NAME gone"
  fi

  # Sandbox ids, also when containerd is not running.
  ids=$(find "$CRI_ROOT/sandboxes" -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null || true)
  if running_pid kubelet >/dev/null; then stop_component kubelet >/dev/null; fi
  rm -f "$PIDS/kubelet.pid" "$PIDS/kubelet.cmd"
  for pid in $(strays_kubelet); do stop_pid "untracked kubelet" "$pid"; done

  if running_pid containerd >/dev/null && healthy_containerd; then
    ids+=" $(ctr_ containers ls -q 2>/dev/null | tr '\n' ' ' || true)"
    for i in $(ctr_ tasks ls -q 2>/dev/null || true); do
      ctr_ tasks rm -f "$i" >/dev/null 2>&1 || true
    done
    # shellcheck disable=SC2086
    [[ -z "${ids// /}" ]] || ctr_ containers rm $ids >/dev/null 2>&1 || true
  fi
  kill_cgroup_procs
  if running_pid containerd >/dev/null; then stop_component containerd >/dev/null; fi
  rm -f "$PIDS/containerd.pid" "$PIDS/containerd.cmd"
  for pid in $(pids_where containerd "$ETC/containerd.toml"); do stop_pid "untracked containerd" "$pid"; done
  for pid in $(pids_where containerd-shim-runc-v2 "$SOCK"); do stop_pid "containerd shim" "$pid"; done
  step_done "kubelet, containers, containerd and shims stopped"

  unmount_all || rc=1
  remove_cgroups || rc=1
  # shellcheck disable=SC2086
  remove_leftovers $ids
  # veths of pods whose network namespace was just released go with it
  for ((i = 0; i < 50; i++)); do
    [[ -z "$(ip -o link show master "$C10M_NODE_BRIDGE" 2>/dev/null)" ]] && break
    sleep 0.1
  done
  ip link del "$C10M_NODE_BRIDGE" 2>/dev/null || true
  remove_kube_chains
  rm -f "$KUBE_CHAINS_BEFORE"
  # In a /var/log/containers that was there before: our pods' log symlinks.
  if [[ -d /var/log/containers ]]; then
    find /var/log/containers -maxdepth 1 -type l -lname "$POD_LOGS/*" -delete 2>/dev/null || true
  fi
  if [[ -f "$HOST_CREATED" ]]; then
    while read -r p; do
      [[ -n "$p" && -e "$p" ]] || continue
      if grep -qF " $p/" /proc/net/unix; then
        warn "$p holds sockets in use; left in place"
        continue
      fi
      [[ -z "$(mounts_under "$p")" ]] || {
        warn "$p has mounts; left in place"
        rc=1
        continue
      }
      rm -rf --one-file-system "$p"
    done <"$HOST_CREATED"
    rm -f "$HOST_CREATED"
  fi
  # Like /run: pod network namespaces, IPAM leases, runc and containerd
  # state; and the CPU/memory managers' assignments to the containers just
  # removed (see up).
  if [[ -z "$(mounts_under "$NODE_DIR")" ]]; then
    rm -rf --one-file-system "$RUN" "$CRI_ROOT/sandboxes" "$CRI_ROOT/containers" \
      "$KROOT/cpu_manager_state" "$KROOT/memory_manager_state"
  fi
  step_done "mounts, cgroups, bridge, iptables chains and host paths cleaned up"
  echo "node: down in $(elapsed "$t0") s"
  return "$rc"
}

# ---------------------------------------------------------------- status
status() {
  local c pid
  for c in "${NODE_COMPONENTS[@]}"; do
    if pid=$(running_pid "$c"); then echo "$c: running (pid $pid)"; else echo "$c: not running"; fi
  done
  ip -br addr show dev "$C10M_NODE_BRIDGE" 2>/dev/null || echo "bridge $C10M_NODE_BRIDGE: absent"
  [[ -f "$FACTS" ]] && sed 's/^/fact: /' "$FACTS"
  if api_up; then
    k get node "$C10M_NODE_NAME" -o wide --show-labels 2>/dev/null || echo "node $C10M_NODE_NAME: not registered"
    k get pods -A --field-selector "spec.nodeName=$C10M_NODE_NAME" -o wide 2>/dev/null
  else
    echo "apiserver: not reachable"
  fi
  if running_pid containerd >/dev/null; then
    echo "containers (ctr -a $SOCK -n k8s.io tasks ls):"
    ctr_ tasks ls 2>/dev/null
  fi
}

env_vars() {
  cat <<EOF
C10M_NODE_NAME=$C10M_NODE_NAME
C10M_NODE_IP=$NODE_IP
C10M_NODE_POD_CIDR=$C10M_NODE_POD_CIDR
C10M_NODE_BRIDGE=$C10M_NODE_BRIDGE
C10M_NODE_CONTAINERD_SOCK=$SOCK
C10M_NODE_CTR="ctr -a $SOCK -n k8s.io"
C10M_NODE_KUBELET_ROOT=$KROOT
C10M_NODE_POD_LOGS=$POD_LOGS
C10M_NODE_KUBELET_LOG=$LOGS/kubelet.log
C10M_NODE_CONTAINERD_LOG=$LOGS/containerd.log
EOF
  if [[ -f "$FACTS" ]]; then sed 's/^\([a-z_]*\)=/C10M_NODE_FACT_\U\1=/' "$FACTS"; fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  import)
    shift
    (($#)) || die "usage: $0 import FILE..."
    healthy_containerd || die "the node's containerd is not running; run $0 up"
    for f in "$@"; do import_archive "$f"; done
    ;;
  env) env_vars ;;
  ctr)
    shift
    ctr_ "$@"
    ;;
  -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' ;;
  *)
    echo "usage: $0 up|down|status|import FILE...|env|ctr ARGS... (try --help)" >&2
    exit 2
    ;;
esac
