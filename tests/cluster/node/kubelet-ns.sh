#!/bin/sh
# kubelet-ns.sh FAKE-DIR KUBELET [ARGS...]: run by node.sh as
#   unshare -m --propagation unchanged kubelet-ns.sh ...
# i.e. in a mount namespace of its own. With protectKernelDefaults the
# kubelet refuses to start unless vm.overcommit_memory=1, vm.panic_on_oom=0,
# kernel.panic=10, kernel.panic_on_oops=1, kernel.keys.root_maxkeys=1000000
# and kernel.keys.root_maxbytes=25000000 (without it, it would write them on
# the host). Here it reads those values from regular files bind-mounted over
# the /proc/sys entries, in this namespace only: /proc is made a slave
# first, so the bind mounts cannot propagate to the host.
#
# The kubelet's root directory is a shared mount (node.sh), so the volumes
# the kubelet mounts there (secrets, configMaps, projected tokens, emptyDir
# medium Memory) propagate to the host's namespace, where containerd sees
# them.
set -eu
fake=$1
shift
mount --make-rslave /proc
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
  kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  key=${kv%=*}
  file=$fake/$(echo "$key" | tr / _)
  echo "${kv#*=}" >"$file"
  mount --bind "$file" "/proc/sys/$key"
done
exec "$@"
