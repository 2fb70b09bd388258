#!/usr/bin/env bash
# mkimage.sh OUT.tar REF USER ENTRYPOINT SRC:DEST [SRC:DEST...]
#
# Writes a FROM-scratch single-layer OCI image archive (an OCI image layout in
# a tar) holding the given files (mode 0755), plus empty /tmp (1777) and /etc.
# No tools beyond tar and sha256sum; the archive is reproducible (sorted
# entries, mtime 0, uid/gid 0). REF must be fully qualified
# (registry/name:tag): it is stored in the io.containerd.image.name
# annotation, which `ctr images import` uses as the image's name.
#
#   mkimage.sh pause.tar c10m.local/pause:1.0 65535:65535 /pause bin/pause:/pause
set -euo pipefail
export LC_ALL=C
(($# >= 5)) || {
  echo "usage: $0 OUT.tar REF USER ENTRYPOINT SRC:DEST..." >&2
  exit 2
}
out=$1 ref=$2 user=$3 entry=$4
shift 4
[[ "$ref" == *.*/*:* || "$ref" == localhost/*:* ]] || {
  echo "mkimage: REF must be registry/name:tag, got '$ref'" >&2
  exit 2
}
case $(uname -m) in
  x86_64) arch=amd64 ;;
  aarch64) arch=arm64 ;;
  *) arch=$(uname -m) ;;
esac

work=$(mktemp -d "$out.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/rootfs layout=$work/layout
mkdir -p "$root/tmp" "$root/etc" "$layout/blobs/sha256"
chmod 1777 "$root/tmp"
for pair in "$@"; do
  src=${pair%%:*} dest=${pair#*:}
  [[ -f "$src" && "$dest" == /* ]] || {
    echo "mkimage: bad SRC:DEST '$pair'" >&2
    exit 2
  }
  install -D -m 0755 "$src" "$root$dest"
done

# blob FILE: moves FILE into the layout's blobs, prints "sha256:<hex> <size>".
blob() {
  local hex size
  hex=$(sha256sum "$1" | cut -d' ' -f1)
  size=$(stat -c %s "$1")
  mv "$1" "$layout/blobs/sha256/$hex"
  echo "sha256:$hex $size"
}

find "$root" -exec touch -h -d @0 {} +
(cd "$root" && find . -mindepth 1 -maxdepth 1 -printf '%P\n' | sort) >"$work/top"
tar -C "$root" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
  --format=gnu -cf "$work/layer.tar" -T "$work/top"
read -r layer_digest layer_size < <(blob "$work/layer.tar")

printf '{"created":"1970-01-01T00:00:00Z","architecture":"%s","os":"linux","config":{"User":"%s","Entrypoint":["%s"],"Env":["PATH=/usr/local/bin:/usr/bin:/bin"]},"rootfs":{"type":"layers","diff_ids":["%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"tests/cluster/node/mkimage.sh"}]}' \
  "$arch" "$user" "$entry" "$layer_digest" >"$work/config.json"
read -r config_digest config_size < <(blob "$work/config.json")

printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
  "$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$work/manifest.json"
read -r manifest_digest manifest_size < <(blob "$work/manifest.json")

printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"},"platform":{"architecture":"%s","os":"linux"}}]}' \
  "$manifest_digest" "$manifest_size" "$ref" "${ref##*:}" "$arch" >"$layout/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"

find "$layout" -exec touch -h -d @0 {} +
tar -C "$layout" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
  --format=gnu -cf "$work/image.tar" oci-layout index.json blobs
mv "$work/image.tar" "$out"
