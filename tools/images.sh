#!/usr/bin/env bash
# tools/images.sh: `make images`. Builds the server image (c10m-server +
# c10m-sysctl, server-image/Dockerfile), the operator image
# (operator/Dockerfile), the loadgen image (c10m-loadgen +
# c10m-calibrate-probe, tools/loadgen/Dockerfile: the probe the operator's
# `calibrate` runs) and the goecho image (a goroutine-per-connection Go echo
# server, tools/goecho: the `backend.model: goroutine` backend the
# calibration tests measure) offline, and writes them as docker-archive tars
# that `ctr -n k8s.io images import` takes under the names the operator, the
# chart and the tests use (docker.io/c10m/{server,operator,loadgen,goecho}:TAG):
#
#   $C10M_CACHE/images/c10m-server.tar
#   $C10M_CACHE/images/c10m-operator.tar
#   $C10M_CACHE/images/c10m-loadgen.tar
#   $C10M_CACHE/images/c10m-goecho.tar
#
# 1. cargo builds the five Rust binaries statically for
#    x86_64-unknown-linux-musl (apart from the debug builds): the server's two
#    and the loadgen's two under the `release` profile
#    (target/x86_64-unknown-linux-musl/release), the operator under
#    `release-size` (…/release-size; Cargo.toml says why). `go build`
#    (CGO_ENABLED=0: static; the standard library only, nothing downloaded)
#    builds goecho into target/goecho/.
# 2. Each image's build context, target/images/{server,operator,loadgen,goecho}/,
#    gets its binaries; the Dockerfiles are FROM scratch and only COPY them.
# 3. buildah (Debian's, daemonless; vfs storage and temp files under
#    $C10M_CACHE/buildah, chroot isolation, nothing pulled) builds each image
#    and pushes it to its archive. An image whose Dockerfile, binaries and this
#    script are unchanged since its archive was written is not rebuilt.
# 4. Prints a JSON array: each image's name, id (its config digest: the image
#    ID crictl shows), size (bytes of its layers, uncompressed) and archive.
#
# usage: tools/images.sh             steps 1-4
#        tools/images.sh --contexts  steps 1-2 only, for `docker build`:
#   docker build -f server-image/Dockerfile -t c10m/server:0.1.0 target/images/server
#   docker build -f operator/Dockerfile -t c10m/operator:0.1.0 target/images/operator
#   docker build -f tools/loadgen/Dockerfile -t c10m/loadgen:0.1.0 target/images/loadgen
#   docker build -f tools/goecho/Dockerfile -t c10m/goecho:0.1.0 target/images/goecho
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

contexts_only=false
case "${1:-}" in
  "") ;;
  --contexts) contexts_only=true ;;
  *) echo "usage: $0 [--contexts]" >&2; exit 2 ;;
esac

cache=${C10M_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/c10m}
# One run at a time (make test and make images from two shells share the
# contexts, the buildah store and the archives).
mkdir -p "$cache"
exec 9>"$cache/images.lock"
flock 9
triple=x86_64-unknown-linux-musl
target_dir=${CARGO_TARGET_DIR:-target}
release_bins=$target_dir/$triple/release
operator_bins=$target_dir/$triple/release-size
goecho_bins=$target_dir/goecho
ctx_root=$target_dir/images

# One version for all images: the workspace's, which the chart's appVersion
# (the operator's tag) and the operator's default server image must match.
tag=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
app=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/c10m-operator/Chart.yaml)
if [[ -z $tag || $tag != "$app" ]]; then
  echo "error: workspace version '$tag' and the chart's appVersion '$app' differ" >&2
  exit 1
fi

# --- 1. static binaries ---------------------------------------------------
# musl, not static glibc: the operator resolves DNS names (a Prometheus
# Service), which static glibc cannot do without NSS in a scratch image.
# ring's C code is compiled with musl-gcc when present (Debian: musl-tools),
# else with the host's cc: ring's C needs no libc headers beyond what both
# share, and the static link would fail on any glibc-only symbol.
if [[ -z ${CC_x86_64_unknown_linux_musl:-} ]] &&
   ! command -v musl-gcc >/dev/null && ! command -v x86_64-linux-musl-gcc >/dev/null; then
  export CC_x86_64_unknown_linux_musl=cc
fi
echo "== cargo build --release --target $triple (c10m-server, c10m-sysctl)" >&2
"${CARGO:-cargo}" build --release --locked --target "$triple" -p c10m-server --bins
echo "== cargo build --release --target $triple (c10m-loadgen, c10m-calibrate-probe)" >&2
"${CARGO:-cargo}" build --release --locked --target "$triple" -p c10m-loadgen --bins
echo "== cargo build --profile release-size --target $triple (c10m-operator)" >&2
"${CARGO:-cargo}" build --profile release-size --locked --target "$triple" \
  -p c10m-operator --bin c10m-operator
echo "== go build (goecho)" >&2
# GOTOOLCHAIN=local: the installed Go builds it (make deps checks >= 1.25),
# never a downloaded one. -trimpath and an empty build id: the same source
# gives the same binary, so an unchanged image is not rebuilt (step 3).
mkdir -p "$goecho_bins"
goecho_out=$(cd "$goecho_bins" && pwd)/goecho
(cd tools/goecho && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS= go build -trimpath \
  -ldflags "-s -w -buildid=" -o "$goecho_out" .)

for bin in "$release_bins/c10m-server" "$release_bins/c10m-sysctl" "$operator_bins/c10m-operator" \
           "$release_bins/c10m-loadgen" "$release_bins/c10m-calibrate-probe" "$goecho_bins/goecho"; do
  if command -v readelf >/dev/null &&
     LC_ALL=C readelf -lW "$bin" | grep -q 'program interpreter'; then
    echo "error: $bin is dynamically linked" >&2
    exit 1
  fi
done

# --- 2. build contexts ----------------------------------------------------
fill() { # fill CONTEXT DIR BINARY...: the context holds exactly these binaries of DIR
  local ctx=$ctx_root/$1 dir=$2; shift 2
  rm -rf "$ctx.new" && mkdir -p "$ctx.new"
  for b in "$@"; do install -m 0755 "$dir/$b" "$ctx.new/$b"; done
  rm -rf "$ctx" && mv "$ctx.new" "$ctx"
}
fill server "$release_bins" c10m-server c10m-sysctl
fill operator "$operator_bins" c10m-operator
fill loadgen "$release_bins" c10m-loadgen c10m-calibrate-probe
fill goecho "$goecho_bins" goecho

if $contexts_only; then
  echo "$ctx_root/server"
  echo "$ctx_root/operator"
  echo "$ctx_root/loadgen"
  echo "$ctx_root/goecho"
  exit 0
fi

# --- 3. buildah -------------------------------------------------------------
command -v buildah >/dev/null || {
  echo "error: buildah not found (Debian: apt-get install buildah; make deps)" >&2
  exit 1
}
store=$cache/buildah
out=$cache/images
mkdir -p "$store/tmp" "$store/data" "$out"
# Everything buildah writes stays under $store: its storage (vfs: no
# fuse-overlayfs or kernel overlay needed), run state, big temp files, and an
# accept-anything signature policy for the local push (no host policy.json
# needed). XDG_DATA_HOME takes a rootless buildah's blob-info cache.
policy=$store/policy.json
echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$policy"
# Its network backend's lock (CNI: /etc/cni/net.d/cni.lock) too; no build
# step runs anything, so no network is ever set up.
mkdir -p "$store/cni"
printf '[network]\nnetwork_config_dir = "%s"\n' "$store/cni" >"$store/containers.conf"
export CONTAINERS_CONF=$store/containers.conf
export TMPDIR=$store/tmp XDG_DATA_HOME=$store/data BUILDAH_ISOLATION=chroot
bah=(buildah --root "$store/root" --runroot "$store/run" --storage-driver vfs)
# A root buildah keeps its blob-info cache in /var/lib/containers/cache, with
# no flag to move it; if that directory is ours (absent before), remove it.
varlib_was_there=false
[[ -e /var/lib/containers ]] && varlib_was_there=true
cleanup_varlib() {
  if ! $varlib_was_there && [[ $(id -u) == 0 ]]; then rm -rf /var/lib/containers; fi
}
trap cleanup_varlib EXIT

script_sum=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
build() { # build NAME DOCKERFILE CONTEXT
  local name=$1 dockerfile=$2 ctx=$3
  local ref=docker.io/c10m/$name:$tag tar=$out/c10m-$name.tar
  local stamp=$out/c10m-$name.inputs inputs
  inputs=$({ echo "$ref $script_sum"; buildah --version
             sha256sum "$dockerfile"; (cd "$ctx" && sha256sum -- *); } | sha256sum | cut -d' ' -f1)
  if [[ -s $tar && -f $stamp && $(<"$stamp") == "$inputs" ]]; then
    echo "== $ref: Dockerfile and binaries unchanged, $tar kept" >&2
    return
  fi
  echo "== buildah bud -f $dockerfile -t $ref $ctx" >&2
  rm -f "$stamp"
  # --timestamp 0 and no buildah-version label: the same binaries give the
  # same image id. --pull=never: nothing is fetched, ever.
  "${bah[@]}" bud --quiet --isolation chroot --pull=never --format oci \
    --timestamp 0 --identity-label=false --signature-policy "$policy" \
    -f "$dockerfile" -t "$ref" "$ctx" >/dev/null
  rm -f "$tar.tmp"
  "${bah[@]}" push --quiet --signature-policy "$policy" \
    "$ref" "docker-archive:$tar.tmp:$ref"
  mv "$tar.tmp" "$tar"
  echo "$inputs" >"$stamp"
  # The previous build of this tag, now untagged, is dropped from the store.
  "${bah[@]}" rmi --prune >/dev/null 2>&1 || true
}
build server server-image/Dockerfile "$ctx_root/server"
build operator operator/Dockerfile "$ctx_root/operator"
build loadgen tools/loadgen/Dockerfile "$ctx_root/loadgen"
build goecho tools/goecho/Dockerfile "$ctx_root/goecho"
cleanup_varlib

# --- 4. report ----------------------------------------------------------------
python3 - "$out/c10m-server.tar" "$out/c10m-operator.tar" "$out/c10m-loadgen.tar" "$out/c10m-goecho.tar" <<'EOF' | tee "$out/images.json"
import hashlib, json, os, sys, tarfile

images = []
for path in sys.argv[1:]:
    with tarfile.open(path) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))[0]
        config = tar.extractfile(manifest["Config"]).read()
        layers = sum(tar.getmember(layer).size for layer in manifest["Layers"])
    images.append({
        "name": manifest["RepoTags"][0],
        "id": "sha256:" + hashlib.sha256(config).hexdigest(),
        "size": layers,
        "archive": path,
        "archive_bytes": os.path.getsize(path),
    })
print(json.dumps(images, indent=1))
EOF
