# Shared settings for the local control plane scripts (sourced, not run).
K8S_VERSION=v1.35.4
K8S_MAJOR=1
K8S_MINOR=35
ETCD_VERSION=v3.6.5
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
# The real node's sandbox image, built by build.sh from node/pause.c (the
# name is baked into the cached archive, so it is not an override).
C10M_PAUSE_IMAGE=c10m.local/pause:1.0
C10M_CACHE=${C10M_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/c10m}
# State of a running plane: PKI, etcd data, logs, pids, kubeconfig.
C10M_STATE=${C10M_STATE:-$C10M_CACHE/cluster}
KUBECONFIG_PATH=$C10M_STATE/kubeconfig
