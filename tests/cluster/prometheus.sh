#!/usr/bin/env bash
# Runs Debian's prometheus against the local control plane, scraping and
# evaluating every 2 s. Debian builds prometheus without
# kubernetes_sd_configs, so pod discovery is c10m-prom-sd (tests/src/bin):
# it watches every pod through https://127.0.0.1:$C10M_APISERVER_PORT
# (admin client certificate, via the admin kubeconfig) and writes a
# file_sd_configs target file with the __meta_kubernetes_* labels of
# Prometheus's role-pod discovery; the scrape config relabels those.
#
#   prometheus.sh start   start both unless healthy ones with the same config
#                         run (idempotent); waits for /-/ready
#   prometheus.sh stop    TERM, then KILL after 15 s (idempotent)
#   prometheus.sh url     print its URL (http://127.0.0.1:$C10M_PROMETHEUS_PORT)
#
# Scraped: Running pods annotated prometheus.io/scrape=true, at
# <podIP>:<prometheus.io/port><prometheus.io/path>, labelled namespace, pod
# and fleet (pod label c10m.dev/fleet). Config, target file and data:
# $C10M_STATE/prometheus; logs: $C10M_STATE/logs/{prometheus,c10m-prom-sd}.log;
# pids: $C10M_STATE/pids/. c10m-prom-sd is built with
# `cargo build -p c10m-e2e --bins` unless $C10M_E2E_BIN_DIR holds it.
set -euo pipefail
export LC_ALL=C
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"

C10M_PROMETHEUS_PORT=${C10M_PROMETHEUS_PORT:-19090}
C10M_PROMETHEUS_BIN=${C10M_PROMETHEUS_BIN:-/usr/bin/prometheus}
URL=http://127.0.0.1:$C10M_PROMETHEUS_PORT
DIR=$C10M_STATE/prometheus
TARGETS=$DIR/pods.json
SD=c10m-prom-sd # pid file names = executable base names (lib.sh running_pid)
PROM=prometheus

# The scrape configuration (written to $DIR/prometheus.yml).
config() {
  cat <<EOF
# Written by tests/cluster/prometheus.sh; edits are overwritten on start.
global:
  scrape_interval: 2s
  scrape_timeout: 2s
  evaluation_interval: 2s
scrape_configs:
- job_name: pods
  # What kubernetes_sd_configs (role: pod, api_server:
  # https://127.0.0.1:$C10M_APISERVER_PORT) would discover, written by c10m-prom-sd.
  file_sd_configs:
  - files: [$TARGETS]
    refresh_interval: 5s
  relabel_configs:
  - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape]
    regex: "true"
    action: keep
  - source_labels: [__meta_kubernetes_pod_phase]
    regex: Running
    action: keep
  - source_labels: [__meta_kubernetes_pod_ip, __meta_kubernetes_pod_annotation_prometheus_io_port]
    regex: "(.+);([0-9]+)"
    replacement: "\${1}:\${2}"
    target_label: __address__
  - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path]
    regex: "(.+)"
    target_label: __metrics_path__
  - source_labels: [__meta_kubernetes_namespace]
    target_label: namespace
  - source_labels: [__meta_kubernetes_pod_name]
    target_label: pod
  - source_labels: [__meta_kubernetes_pod_label_c10m_dev_fleet]
    target_label: fleet
EOF
}

ready() { curl -fsS --noproxy '*' --max-time 2 "$URL/-/ready" >/dev/null 2>&1; }

# Serialises start/stop (not the plane's lock: down.sh holds that one while
# it calls `prometheus.sh stop`).
lock() {
  mkdir -p "$C10M_STATE"
  exec 8>"$C10M_STATE/.prometheus.lock"
  flock -w 300 8 || die "another prometheus.sh holds $C10M_STATE/.prometheus.lock"
}

# The c10m-prom-sd binary, built if needed.
sd_bin() {
  if [[ -n "${C10M_E2E_BIN_DIR:-}" ]]; then
    echo "$C10M_E2E_BIN_DIR/$SD"
    return
  fi
  local root
  root=$(cd "$here/../.." && pwd)
  (cd "$root" && cargo build -q -p c10m-e2e --bins) >&2 || die "cargo build -p c10m-e2e --bins failed"
  echo "$root/target/debug/$SD"
}

# For launch (lib.sh).
healthy_c10m-prom-sd() { [[ -s "$TARGETS" ]]; }
healthy_prometheus() { ready; }

start() {
  [[ -x "$C10M_PROMETHEUS_BIN" ]] || die "$C10M_PROMETHEUS_BIN not found; run $here/install-deps.sh"
  [[ -f "$KUBECONFIG_PATH" ]] || die "$KUBECONFIG_PATH not found; run $here/up.sh first"
  local bin record owner sd_cmd cmd
  bin=$(sd_bin)
  [[ -x "$bin" ]] || die "$bin not found"
  lock
  mkdir -p "$DIR/data" "$PIDS" "$LOGS"

  # Discovery first, so prometheus starts with a complete target file.
  # (exec env: the pid file names the binary itself, not env.)
  sd_cmd=(env KUBECONFIG="$KUBECONFIG_PATH" "$bin" --output "$TARGETS")
  record="$(printf '%q ' "${sd_cmd[@]}")# $(sha256sum <"$bin" | cut -c1-16)"
  running_pid "$SD" >/dev/null || rm -f "$TARGETS" # healthy once it writes one
  if launch "$SD" "$record" "${sd_cmd[@]}"; then
    wait_healthy "$SD" 30
  fi

  config >"$DIR/prometheus.yml.tmp"
  "${C10M_PROMETHEUS_BIN%/*}/promtool" check config "$DIR/prometheus.yml.tmp" >/dev/null ||
    die "promtool rejects the generated config ($DIR/prometheus.yml.tmp)"
  mv "$DIR/prometheus.yml.tmp" "$DIR/prometheus.yml"
  cmd=("$C10M_PROMETHEUS_BIN"
    --config.file="$DIR/prometheus.yml"
    --storage.tsdb.path="$DIR/data"
    --storage.tsdb.retention.time=1d
    --web.listen-address="127.0.0.1:$C10M_PROMETHEUS_PORT"
    --web.enable-lifecycle
    --log.level=warn)
  record="$(printf '%q ' "${cmd[@]}")# config sha256 $(sha256sum <"$DIR/prometheus.yml" | cut -c1-16)"
  if ! running_pid "$PROM" >/dev/null; then
    owner=$(ss -Hltnp "( sport = :$C10M_PROMETHEUS_PORT )" 2>/dev/null | head -n1)
    [[ -z "$owner" ]] || die "cannot start prometheus: port $C10M_PROMETHEUS_PORT is in use: $owner"
  fi
  if launch "$PROM" "$record" "${cmd[@]}"; then
    wait_healthy "$PROM" 30
  fi
  echo "prometheus: ready at $URL"
}

stop() {
  lock
  stop_component "$PROM"
  stop_component "$SD"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  url) echo "$URL" ;;
  -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) die "usage: $0 start|stop|url" ;;
esac
