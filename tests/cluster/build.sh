#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules and caches them
# outside the repo, keyed by a hash of go.sum, go.mod, env.sh, node/pause.c,
# node/mkimage.sh and this script:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet (k8s.io/kubernetes, see go.mod)
#   etcd (go.etcd.io/etcd/server/v3/etcdmain, cmd/etcd)
#   kwok (sigs.k8s.io/kwok/cmd/kwok, with kwok-ip-pool.patch: a pod gets a
#     never-used IP first, then the one released longest ago, as host-local
#     IPAM hands them out; upstream may hand a new pod the IP of a pod whose
#     server still drains) and helm (helm.sh/helm/v3/cmd/helm)
#   pause (node/pause.c, gcc -static) and pause-image.tar, the real node's
#     sandbox image $C10M_PAUSE_IMAGE (an OCI archive, node/mkimage.sh)
# Prints the cache directory holding the binaries on its last line.
# A warm cache returns at once; every binary's version is checked either way.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"

key=$(cat "$here/go.sum" "$here/go.mod" "$here/build.sh" "$here/env.sh" "$here/kwok-ip-pool.patch" "$here/node/pause.c" "$here/node/mkimage.sh" |
  sha256sum | cut -c1-16)
bin="$C10M_CACHE/bin/$key"

# Outputs are captured before matching: `cmd | grep -q` under pipefail fails
# at random when grep exits before cmd has written everything (SIGPIPE).
check_versions() {
  local c v
  for c in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    v=$("$bin/$c" --version) && [[ $v == "Kubernetes $K8S_VERSION" ]] || return 1
  done
  v=$("$bin/etcd" --version) && [[ $v == *"etcd Version: ${ETCD_VERSION#v}"* ]] || return 1
  v=$("$bin/kwok" --version) && [[ $v == *"${KWOK_VERSION#v}"* ]] || return 1
  v=$("$bin/helm" version --template '{{.Version}}') && [[ $v == "$HELM_VERSION" ]] || return 1
  [[ -x "$bin/pause" && -s "$bin/pause-image.tar" ]] || return 1
}

mkdir -p "$C10M_CACHE/bin"
# One build at a time (concurrent `make test` / `make demo` runs wait here).
exec 9>"$C10M_CACHE/bin/.lock"
flock 9

if [ -f "$bin/.complete" ] && check_versions 2>/dev/null; then
  echo "$bin"
  exit 0
fi

command -v gcc >/dev/null || { echo "build.sh: gcc not found (needed for the node's pause binary); run $here/install-deps.sh" >&2; exit 1; }
mkdir -p "$bin.tmp"
start=$(date +%s)
cd "$here"
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
  -X k8s.io/component-base/version.gitMajor=${K8S_MAJOR} -X k8s.io/component-base/version.gitMinor=${K8S_MINOR} \
  -X k8s.io/component-base/version.gitTreeState=clean \
  -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
  echo "building $cmd $K8S_VERSION" >&2
  go build -trimpath -ldflags "$ldflags" -o "$bin.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
echo "building etcd $ETCD_VERSION" >&2
go build -trimpath -ldflags "-s -w" -o "$bin.tmp/etcd" ./cmd/etcd
echo "installing kwok $KWOK_VERSION and helm $HELM_VERSION" >&2
kwok_src=$(GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d "$kwok_src" ]] || { echo "build.sh: go mod download sigs.k8s.io/kwok@$KWOK_VERSION gave no source directory" >&2; exit 1; }
rm -rf "$bin.tmp/kwok-src"
cp -r "$kwok_src" "$bin.tmp/kwok-src"
chmod -R u+w "$bin.tmp/kwok-src"
patch -s -p1 -d "$bin.tmp/kwok-src" <"$here/kwok-ip-pool.patch"
(cd "$bin.tmp/kwok-src" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" -o "$bin.tmp/kwok" ./cmd/kwok)
rm -rf "$bin.tmp/kwok-src"
GOBIN="$bin.tmp" go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
echo "building pause and $C10M_PAUSE_IMAGE" >&2
gcc -static -O2 -s -o "$bin.tmp/pause" "$here/node/pause.c"
"$here/node/mkimage.sh" "$bin.tmp/pause-image.tar" "$C10M_PAUSE_IMAGE" 65535:65535 /pause "$bin.tmp/pause:/pause"
rm -rf "$bin"
mv "$bin.tmp" "$bin"
check_versions || { echo "build.sh: a built binary reports the wrong version" >&2; exit 1; }
touch "$bin/.complete"
# Binaries of other go.sum versions are stale; a running plane keeps its open files.
find "$C10M_CACHE/bin" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -exec rm -rf {} +
echo "built in $(( $(date +%s) - start )) s" >&2
echo "$bin"
