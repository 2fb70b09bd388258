#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks for the local control plane, its
# real node and the tests: Debian packages via apt-get (apt-get update only
# when something is missing), and the Rust targets and components
# rust-toolchain.toml lists (rustup). Go and kubectl are expected to be
# preinstalled; this checks them and fails with a clear message if they are
# missing. Quiet when all is present.
set -euo pipefail
export LC_ALL=C

# package:command-or-file that proves it is installed
wanted=(
  openssl:openssl
  curl:curl
  ca-certificates:/etc/ssl/certs/ca-certificates.crt
  iproute2:ss
  util-linux:flock
  # build.sh patches kwok (kwok-ip-pool.patch)
  patch:patch
  prometheus:prometheus
  # the real node (node.sh): container runtime, CNI plugins, and gcc +
  # libc6-dev for its static pause binary (build.sh); iptables-save lists
  # the chains host-state.sh compares
  containerd:containerd
  runc:/usr/sbin/runc
  containernetworking-plugins:/usr/lib/cni/bridge
  iptables:/usr/sbin/iptables-save
  # make images (tools/images.sh): the daemonless image builder
  buildah:buildah
  gcc:gcc
  libc6-dev:/usr/include/stdio.h
)

installed() { # PROBE
  if [[ "$1" == /* ]]; then [[ -e "$1" ]]; else command -v "$1" >/dev/null 2>&1; fi
}

missing=()
for entry in "${wanted[@]}"; do
  pkg=${entry%%:*}
  probe=${entry#*:}
  installed "$probe" || missing+=("$pkg")
done

if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  command -v apt-get >/dev/null || {
    echo "error: apt-get not found; install these packages by hand: ${missing[*]}" >&2
    exit 1
  }
  sudo=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null || {
      echo "error: not root and no sudo; as root run: apt-get install ${missing[*]}" >&2
      exit 1
    }
    sudo=(sudo)
  fi
  # Packages such as prometheus start a service on install; keep them from
  # doing so (the tests start what they need, on 127.0.0.1 only).
  policy=/usr/sbin/policy-rc.d
  if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
    "${sudo[@]}" chmod 755 "$policy"
    trap '"${sudo[@]}" rm -f "$policy"' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  for entry in "${wanted[@]}"; do
    installed "${entry#*:}" || {
      echo "error: ${entry%%:*} still missing after apt-get install" >&2
      exit 1
    }
  done
  echo "install-deps: installed ${missing[*]}"
fi

# Rust: the toolchain rust-toolchain.toml names, with its targets and
# components. rustup installs them when it installs the toolchain, but it
# does not add them to a toolchain already installed without them (a
# machine with 1.95.0 but no x86_64-unknown-linux-musl then fails
# `make images` with E0463 "can't find crate for core"). Both adds are
# idempotent and quiet when everything is present.
if command -v rustup >/dev/null; then
  toolchain_file=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/rust-toolchain.toml
  read -r channel targets components < <(python3 - "$toolchain_file" <<'PY'
import sys, tomllib
t = tomllib.load(open(sys.argv[1], "rb"))["toolchain"]
print(t["channel"], ",".join(t.get("targets", [])) or "-", ",".join(t.get("components", [])) or "-")
PY
)
  installed_targets=$(rustup target list --installed --toolchain "$channel" 2>/dev/null || true)
  installed_components=$(rustup component list --installed --toolchain "$channel" 2>/dev/null || true)
  if [[ $targets != - ]]; then
    for t in ${targets//,/ }; do
      grep -qxF "$t" <<<"$installed_targets" && continue
      echo "install-deps: rustup target add --toolchain $channel $t"
      rustup target add --toolchain "$channel" "$t"
    done
  fi
  if [[ $components != - ]]; then
    for c in ${components//,/ }; do
      grep -q "^$c-" <<<"$installed_components" && continue
      echo "install-deps: rustup component add --toolchain $channel $c"
      rustup component add --toolchain "$channel" "$c"
    done
  fi
else
  echo "error: rustup not found; install Rust with rustup (https://rustup.rs): the toolchain, targets and components come from rust-toolchain.toml" >&2
  exit 1
fi

# Python's `websockets` (>= 13, PyPI): the independent WebSocket client that
# server-image/tests/websocket.rs checks c10m-server against.
if ! python3 -c 'import websockets, sys; sys.exit(int(websockets.__version__.split(".")[0]) < 13)' 2>/dev/null; then
  echo "install-deps: installing python3 websockets"
  python3 -m pip install --quiet 'websockets>=13' 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages 'websockets>=13'
fi

# Preinstalled on our machines; not installed by this script.
if ! command -v go >/dev/null; then
  echo "error: go not found in PATH. Install Go >= 1.25 (https://go.dev/dl/) and put it on PATH;" \
    "tests/cluster/build.sh compiles the control plane with it." >&2
  exit 1
fi
go_version=$(go env GOVERSION 2>/dev/null || true)
if [[ ! "$go_version" =~ ^go1\.([0-9]+) ]] || ((BASH_REMATCH[1] < 25)); then
  echo "error: Go >= 1.25 is required (tests/cluster/go.mod); found '${go_version:-unknown}'" >&2
  exit 1
fi
if ! command -v kubectl >/dev/null; then
  echo "error: kubectl not found in PATH. Install kubectl (>= 1.32) from" \
    "https://kubernetes.io/docs/tasks/tools/; up.sh and the tests use it." >&2
  exit 1
fi
