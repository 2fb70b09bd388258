#!/usr/bin/env bash
# Prints a sorted listing of the host state that the local plane's real node
# (node.sh) could change, so that a listing taken before `up.sh` and one taken
# after `down.sh` can be diffed (tests/run.sh does). Read-only: it runs no
# command that creates anything (iptables-save lists existing tables only;
# the legacy iptables tables are listed only if their kernel module is
# already loaded).
#
#   mount    mount point, fs type, source, propagation (no ids)
#   cgroup   top-level directories of every cgroup hierarchy (v1 and v2)
#   link     network links;  addr  their addresses;  route  routes (all tables)
#   iptables chains and rules of every table, IPv4 and IPv6 (nft and legacy)
#   sysctl   the settings kubelet touches or checks, IP forwarding, net.bridge.*
#   path     host paths kubelet/containerd/CNI use by default, two levels deep
#   process  processes running kubelet, containerd, a containerd shim or runc
set -euo pipefail
export LC_ALL=C

{
  # /proc/self/mountinfo: id parent major:minor root mountpoint options
  # optional-fields... - fstype source superoptions
  while read -r line; do
    read -ra f <<<"$line"
    prop=private
    for ((i = 6; i < ${#f[@]}; i++)); do
      case ${f[i]} in
        -) break ;;
        shared:*) prop=shared ;;
        master:*) prop="$prop,slave" ;;
      esac
    done
    rest=${line#* - }
    read -r fstype source _ <<<"$rest"
    echo "mount ${f[4]} $fstype $source $prop"
  done </proc/self/mountinfo

  while read -r _ mnt fstype _; do
    [[ "$fstype" == cgroup || "$fstype" == cgroup2 ]] || continue
    for d in "$mnt"/*/; do
      [[ -d "$d" ]] && echo "cgroup $mnt $(basename "$d")"
    done
  done </proc/self/mounts

  if command -v ip >/dev/null; then
    ip -o link show | awk '{ sub(/:$/, "", $2); sub(/@.*/, "", $2); print "link " $2 }'
    ip -o addr show | awk '{ print "addr " $2 " " $3 " " $4 }'
    ip -4 route show table all | sed 's/^/route4 /'
    ip -6 route show table all | sed 's/^/route6 /'
  fi

  # iptables-save: "*table", ":CHAIN POLICY [counters]", "-A CHAIN ...".
  save() { # LABEL COMMAND
    command -v "$2" >/dev/null || return 0
    "$2" 2>/dev/null | awk -v l="$1" '
      /^\*/ { t = substr($0, 2) }
      /^:/ { print l " " t " chain " substr($1, 2) }
      /^-A / { print l " " t " rule " substr($0, 4) }'
  }
  save iptables4 iptables-save
  save iptables6 ip6tables-save
  if [[ -e /proc/net/ip_tables_names ]]; then save iptables4-legacy iptables-legacy-save; fi
  if [[ -e /proc/net/ip6_tables_names ]]; then save iptables6-legacy ip6tables-legacy-save; fi

  for f in /proc/sys/vm/overcommit_memory /proc/sys/vm/panic_on_oom /proc/sys/kernel/panic \
    /proc/sys/kernel/panic_on_oops /proc/sys/net/ipv4/ip_forward \
    /proc/sys/net/ipv4/conf/all/forwarding /proc/sys/net/ipv6/conf/all/forwarding \
    /proc/sys/kernel/keys/* /proc/sys/net/bridge/*; do
    [[ -f "$f" ]] || continue
    key=${f#/proc/sys/}
    echo "sysctl ${key//\//.} = $(tr '\t\n' '  ' <"$f" | sed 's/ *$//')"
  done

  for p in /var/lib/kubelet /run/containerd /var/run/containerd /var/lib/containerd \
    /etc/cni /opt/cni /var/lib/cni /run/cni /var/log/containers /var/log/pods \
    /usr/libexec/kubernetes /etc/kubernetes /run/netns /var/run/netns; do
    [[ -e "$p" || -L "$p" ]] || continue
    find "$p" -maxdepth 2 -printf 'path %p %y\n' 2>/dev/null || true
  done

  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    case ${exe##*/} in
      kubelet | containerd | containerd-shim* | runc) echo "process ${exe##*/} ${exe% (deleted)}" ;;
    esac
  done
} | sort
