#!/usr/bin/env python3
"""Capacity proof: one shard, planned by the real planner, filled to its cap
inside the memory cgroup and network namespace the plan describes
(`make bench-fidelity`, issue 8 item 7). Writes JSON to --out and prints it.

Plan. A scaled-down ConnectionFleet (1 CPU per shard, bundled epoll server,
echo, node = this machine: its MemTotal and CPUs, the 20,000 hard
RLIMIT_NOFILE it gives a process, no CAP_SYS_RESOURCE for the server, no
host network namespace, no conntrack on the loopback path) is planned with
`c10m-operator plan -f FILE -o json` once per cgroup mode
(`spec.node.cgroupMode: v1` and `v2`). `spec.connections` is rescaled (at
most a few plans) until the plan's `shardConnectionLimit` is within
15,000-18,000. Read from the plan, never assumed: shardConnectionLimit,
memoryLimitBytes, nofile, workers, listenBacklog, sysctls,
podBytesPerConnection {user, kernel, total}, slowReadersPerShard and
slowReaderBytes {user, kernel, total}; a missing field stops the run.

Shard. One real target/release/c10m-server (the plan's workers = 1, echo,
the plan's nofile, max connections = shardConnectionLimit, the plan's listen
backlog), pinned to one CPU as a pod's cpuset would, started inside a fresh
memory cgroup v1 /sys/fs/cgroup/memory/c10m-fidelity-<mode> whose
memory.limit_in_bytes is the plan's memoryLimitBytes, and inside a network
namespace c10m-fidelity-<mode> (loopback up) in which the plan's namespaced
sysctls are set (net.core.somaxconn, net.ipv4.tcp_rmem, net.ipv4.tcp_wmem,
...; per netns, so the host is untouched). Node-level sysctls of the plan
are not applied; they are listed under sysctlsNotApplied with the host's
value. Clients are Python processes of this script in the same netns but in
this script's own memory cgroup (not the shard's): at most PER_CLIENT
connections each (RLIMIT_NOFILE is 20,000 per process here), source
addresses spread over 127.0.1.x with IP_BIND_ADDRESS_NO_PORT.

Modes.
  v1               cgroup v1 as Kubernetes leaves it: nothing writes
                   memory.kmem.tcp.*, so socket accounting is off: the
                   tcp_sock object and socket buffer pages are not charged to
                   the pod; file, inode, dentry and epoll items are.
                   pod bytes = memory.usage_in_bytes.
  socketAccounted  stands in for cgroup v2 (planned with cgroupMode v2):
                   writing memory.kmem.tcp.limit_in_bytes of any v1 memory
                   cgroup switches socket accounting on host-wide (a static
                   key) for sockets created afterwards; the script writes
                   2^50 on the shard's own cgroup. The socket object is then
                   charged to memory.usage_in_bytes, but v1 puts the TCP
                   buffer pages in a separate counter,
                   memory.kmem.tcp.usage_in_bytes, outside
                   memory.limit_in_bytes (v2 has both in memory.current
                   against one limit). So here
                   pod bytes = memory.usage_in_bytes + memory.kmem.tcp.usage_in_bytes
                   peak      = memory.max_usage_in_bytes + memory.kmem.tcp.max_usage_in_bytes
                   (a sum of two peaks: at least the peak of the sum), and
                   failcnt/OOM cannot see the buffer pages, which is why
                   peakUsageOverLimit is also a target. The switch is released
                   when that cgroup is gone (and its sockets with it).
Every cgroup and netns the script creates is removed after each mode and at
the end, on success, failure, SIGINT/SIGTERM/SIGHUP, and checked gone;
leftovers of an earlier killed run are removed at the start. Nothing else
host-wide is changed. That the switch is off again is checked, not assumed:
a probe (socketAccountingProbe) charges PROBE_CONNECTIONS idle connections
to a fresh cgroup with no kmem.tcp write, before the modes and after the
cleanup (retried for up to 30 s while the removed cgroups are freed); both
must agree within half a tcp_sock (1,184 B), else the run fails. The first
probe also stops the run if the switch is already on (someone else wrote a
kmem.tcp limit): at least a whole tcp_sock (2,368 B) per connection.

Fill, per mode (cap = shardConnectionLimit, slow = slowReadersPerShard):
 1. Idle: cap - slow connections that never send. Baseline before any
    client connects; after the server's /metrics c10m_connections reports
    them all and a settle pause:
      measuredPodBytesPerConnection = pod bytes delta / idle
      ...User   = server VmRSS delta / idle
      ...Kernel = the rest
    compared with the plan's podBytesPerConnection (total, user, kernel).
    acceptsPerSecond = idle / (first client connect -> /metrics reports all
    idle), polled every 5 ms. The clients (2 processes) run on the same
    2 CPUs as the server's one pinned worker, and on loopback the kernel's
    handshake work runs in the connecting side's context, so this is the
    rate the shard sustained here, not a NIC-fed server's rate.
    serverCpuBusyDuringFill = the server's CPU seconds (all threads) over
    the same interval: below 1, the clients, not the worker, set the pace.
 2. Slow readers: slow connections that each send SLOW_SEND_BYTES (1 MiB)
    non-blocking as far as the kernel takes it, keep the rest unsent and
    never read. The echo server's send queue fills, it holds the unsent
    tail of one read in user space and stops reading, its receive queue
    fills. Settled when no client can send more for 3 rounds 0.25 s apart
    and sockstat `TCP mem` is steady. Then, per slow reader and beyond an
    idle connection (as the plan's slowReaderBytes is):
      measuredSlowReaderPodBytes     = pod bytes delta / slow
                                       - measuredPodBytesPerConnection
      measuredSlowReaderUserBytes    = server VmRSS delta / slow
                                       - measuredPodBytesPerConnectionUser
      measuredSlowReaderKernelBytes  = server-side sockets' skmem r + w + f
                                       (`ss -tnm` in the netns) / slow; the
                                       parts: measuredSlowReaderKernelParts
                                       (r receive queue, w send queue, f
                                       forward-allocated)
      measuredSlowReaderSockstatBytes = /proc/net/sockstat TCP mem pages
                                       delta x 4096 / slow (global: both the
                                       server's and the clients' ends, and
                                       anything else on the host, which
                                       should be quiet)
    compared with the plan's slowReaderBytes.total (predictedSlowReaderBytes,
    also ...User/...Kernel) and with what the plan charges the pod for one
    (predictedSlowReaderPodBytes: user, plus kernel in socketAccounted).

Row extras kept to the ones above plus: podBytesBeforeClients (the shard's
charge with the server up and no client, next to the plan's processBytes,
plannedProcessBytes), peakPodBytes, tcpMemPeakPages, the sysctls applied
and not, connect errors, and what each side says is held.

Row: connections = connections still open at the end (clients' view: no
POLLRDHUP/HUP/ERR; /metrics must agree); peakUsageOverLimit = peak pod bytes /
memoryLimitBytes; failcnt = memory.failcnt; oomKills = oom_kill in
memory.oom_control (and serverAlive); tcpMemPagesOverPressure = peak sockstat
`TCP mem` pages (sampled throughout, global) / the host's tcp_mem pressure
(2nd field of /proc/sys/net/ipv4/tcp_mem). Top level:
acceptsPerSecondPerWorker = the lowest of the modes' acceptsPerSecond.

Targets (exit 1 after writing the JSON if any fails, or if a row holds fewer
than its cap): 0 OOM kills, failcnt 0, peakUsageOverLimit <= 1 (the v2
limit would count socket buffers too), idle measured / predicted pod bytes
within 0.9-1.1 in each mode, tcpMemPagesOverPressure < 1.

Usage (root; cgroup v1 memory controller; iproute2):
  fidelity.py [--release target/release] [--operator PATH] [--out FILE]
Standard library only.
"""
import argparse
import ctypes
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CGROUP_ROOT = "/sys/fs/cgroup/memory"
PREFIX = "c10m-fidelity"
# (row mode, spec.node.cgroupMode planned for it)
MODES = (("v1", "v1"), ("socketAccounted", "v2"))
CAP_RANGE = (15_000, 18_000)
SLOW_SEND_BYTES = 1 << 20
PER_CLIENT = 9_000  # connections per client process (RLIMIT_NOFILE 20,000)
MIN_CLIENTS = 2
SERVER_PORT = 7000  # spec.server defaults
METRICS_PORT = 9090
TCP_LIMIT = 1 << 50  # "very large" memory.kmem.tcp.limit_in_bytes
PROBE_CONNECTIONS = 2_000
# The IPv4 tcp_sock object, 2,368 B [docs/KERNEL_FACTS.md, measured on 6.18]:
# with socket accounting off an idle connection charges its cgroup less than
# one (file, inode, dentry, epoll: ~1.5 KB); with it on, more.
TCP_SOCK_BYTES = 2368
SOCK_HALF = TCP_SOCK_BYTES // 2  # the probe's before/after margin
PAGE = os.sysconf("SC_PAGE_SIZE")
IP_BIND_ADDRESS_NO_PORT = 24
CLONE_NEWNET = 0x40000000
REQUIRED = ("shardConnectionLimit", "memoryLimitBytes", "nofile", "workers", "sysctls",
            "podBytesPerConnection", "slowReadersPerShard", "slowReaderBytes")
PARTS = ("user", "kernel", "total")


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    pass


def fail(msg):
    raise SystemExit(f"fidelity: {msg}")


def log(msg):
    print(f"fidelity: {msg}", file=sys.stderr, flush=True)


# --- host probes ----------------------------------------------------------

def read(path):
    with open(path) as f:
        return f.read().strip()


def write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


def read_int(path):
    return int(read(path))


def sockstat():
    """TCP line of /proc/net/sockstat of the caller's netns (mem is global)."""
    with open("/proc/net/sockstat") as f:
        for line in f:
            if line.startswith("TCP:"):
                p = line.split()[1:]
                return {p[i]: int(p[i + 1]) for i in range(0, len(p), 2)}
    return {}


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid):
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_total():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal")


_libc = ctypes.CDLL(None, use_errno=True)


def setns(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def metrics(port=METRICS_PORT):
    """Live connections the server reports (c10m_connections, all workers)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    conns = 0.0
    for line in body.splitlines():
        if line.startswith("c10m_connections{") or line.startswith("c10m_connections "):
            conns += float(line.split()[-1])
    return int(conns)


def live(server):
    """metrics(), or -1 when the server is gone or does not answer."""
    if server.poll() is not None:
        return -1
    try:
        return metrics()
    except OSError:
        return -1


def ss_server_skmem(port):
    """Sum of skmem r (rmem_alloc), w (wmem_queued), f (forward_alloc) over the
    server's established sockets (local port = port), from `ss -tnm`."""
    out = subprocess.run(["ss", "-tnmH", "state", "established", f"( sport = :{port} )"],
                         check=True, capture_output=True, text=True).stdout
    tot = {"r": 0, "w": 0, "f": 0, "sockets": 0}
    for m in re.finditer(r"skmem:\(([^)]*)\)", out):
        tot["sockets"] += 1
        for field in m.group(1).split(","):
            k = re.match(r"([a-z]+)(\d+)", field)
            if k and k.group(1) in ("r", "w", "f"):
                tot[k.group(1)] += int(k.group(2))
    return tot


# --- the client processes ---------------------------------------------------

def client_main(index):
    """Child: holds connections on the orders of the parent (one JSON line on
    stdin each, one JSON line back). Runs in the shard's netns, outside its
    memory cgroup."""
    idle, slow, remaining = [], [], {}
    chunk = memoryview(b"x" * 65536)
    target = ("127.0.0.1", SERVER_PORT)
    made = [0]

    def connect():
        i = made[0]
        made[0] += 1
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((f"127.0.1.{1 + index * 8 + i % 8}", 0))
        try:  # blocking, no timeout: the listen backlog holds every handshake
            s.connect(target)
        except OSError:
            s.close()
            raise
        return s

    def pump():
        sent = 0
        for s in slow:
            left = remaining[s]
            while left > 0:
                try:
                    n = s.send(chunk[:min(left, len(chunk))])
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    left = 0
                    break
                sent += n
                left -= n
            remaining[s] = left
        return sent

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        if op in ("idle", "slow"):
            errors, first_error, first = 0, None, None
            for _ in range(cmd["n"]):
                t = time.monotonic()
                try:
                    s = connect()
                except OSError as e:
                    errors += 1
                    first_error = first_error or repr(e)
                    continue
                first = t if first is None else first
                if op == "idle":
                    idle.append(s)
                else:
                    s.setblocking(False)
                    remaining[s] = SLOW_SEND_BYTES
                    slow.append(s)
            sent = pump() if op == "slow" else 0
            reply({"errors": errors, "firstError": first_error, "firstConnect": first,
                   "lastConnect": time.monotonic(), "sent": sent})
        elif op == "pump":
            sent = pump()
            reply({"sent": sent, "unsent": sum(remaining.values())})
        elif op == "check":
            p = select.poll()
            fds = {}
            for kind, socks in (("idle", idle), ("slow", slow)):
                for s in socks:
                    p.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                    fds[s.fileno()] = kind
            dropped = {"idle": 0, "slow": 0}
            for fd, ev in p.poll(0):
                if ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                    dropped[fds[fd]] += 1
            reply({"idle": len(idle) - dropped["idle"], "slow": len(slow) - dropped["slow"],
                   "dropped": dropped})
        elif op == "quit":
            break
    os._exit(0)  # no orderly close of every socket; the parent removes the netns


class Clients:
    def __init__(self, count, script):
        self.procs = []
        for k in range(count):
            p = subprocess.Popen([sys.executable, script, "--client", str(k)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(p)
        for p in self.procs:
            self._read(p, 30)

    def _read(self, p, timeout):
        r, _, _ = select.select([p.stdout], [], [], timeout)
        if not r:
            raise RuntimeError(f"client {p.pid} did not answer within {timeout} s")
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"client {p.pid} exited ({p.poll()})")
        return json.loads(line)

    def send(self, cmds):
        for p, c in zip(self.procs, cmds):
            p.stdin.write(json.dumps(c) + "\n")
            p.stdin.flush()

    def pending(self):
        return [p.stdout for p in self.procs]

    def collect(self, timeout=300):
        return [self._read(p, timeout) for p in self.procs]

    def all(self, cmd, timeout=300):
        self.send([cmd] * len(self.procs))
        return self.collect(timeout)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write('{"cmd":"quit"}\n')
                    p.stdin.flush()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def split(n, parts):
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


# --- plan ----------------------------------------------------------------------

def run_plan(operator, connections, cgroup_mode):
    spec = {
        "connections": connections,
        "backend": {"model": "epoll", "protocol": "echo"},
        "shard": {"cpus": 1},
        "node": {
            "memory": str(mem_total()),
            "cpus": len(os.sched_getaffinity(0)),
            "conntrack": False,
            "nofileHardLimit": min(os.sysconf("SC_OPEN_MAX"), 1 << 30),
            "sysResource": False,
            "hostNetworkNamespace": False,
            "cgroupMode": cgroup_mode,
        },
    }
    manifest = {"apiVersion": "c10m.dev/v1alpha1", "kind": "ConnectionFleet",
                "metadata": {"name": "fidelity", "namespace": "default"}, "spec": spec}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="c10m-fidelity-") as f:
        json.dump(manifest, f)  # JSON is YAML
        f.flush()
        r = subprocess.run([operator, "plan", "-f", f.name, "-o", "json"], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"`{operator} plan` failed ({r.returncode}):\n{r.stderr.strip()}")
    plan = json.loads(r.stdout)
    if isinstance(plan, list):
        plan = plan[0]
    plan = plan.get("plan", plan)
    return spec, plan


def check_plan(plan, cgroup_mode, operator):
    missing = [k for k in REQUIRED if k not in plan]
    for k in ("podBytesPerConnection", "slowReaderBytes"):
        if k in plan and not all(p in (plan[k] or {}) for p in PARTS):
            missing.append(f"{k}.{{{','.join(PARTS)}}}")
    for k in ("podBytesPerConnection", "slowReaderBytes"):
        if k not in missing and k in plan and (plan[k] or {}).get("total", 0) <= 0 \
                and (k == "podBytesPerConnection" or plan.get("slowReadersPerShard", 0) > 0):
            missing.append(f"{k} (total is 0: a default, not a figure)")
    if missing:
        fail(f"the plan of {operator} has no {', '.join(missing)} (cgroupMode {cgroup_mode}); "
             "this benchmark needs the capacity model that reports them: rebuild "
             "`cargo build --release -p c10m-operator` from a tree that has it")
    if "cgroupMode" in plan and str(plan["cgroupMode"]).lower() != cgroup_mode:
        fail(f"asked for spec.node.cgroupMode {cgroup_mode}, the plan says {plan['cgroupMode']}")
    if plan["workers"] != 1:
        fail(f"the plan has {plan['workers']} workers per shard, expected 1 (shard.cpus 1)")
    if plan["slowReadersPerShard"] >= plan["shardConnectionLimit"]:
        fail("slowReadersPerShard >= shardConnectionLimit")


def plan_for(operator, cgroup_mode):
    """Rescales spec.connections until shardConnectionLimit is in CAP_RANGE."""
    connections = 13_000
    for _ in range(6):
        spec, plan = run_plan(operator, connections, cgroup_mode)
        check_plan(plan, cgroup_mode, operator)
        cap = plan["shardConnectionLimit"]
        if CAP_RANGE[0] <= cap <= CAP_RANGE[1]:
            return spec, plan
        connections = max(1000, round(connections * sum(CAP_RANGE) / 2 / cap))
    fail(f"no spec.connections gives a shardConnectionLimit within {CAP_RANGE} "
         f"(last: {connections} -> {cap}, limitingFactor {plan.get('limitingFactor')})")


# --- setup and teardown ------------------------------------------------------

class Host:
    """Everything the run creates, removed by cleanup() (also on a signal)."""

    def __init__(self):
        self.host_netns = os.open("/proc/self/ns/net", os.O_RDONLY)
        self.netns, self.cgroups, self.procs, self.clients, self.files = [], [], [], [], []
        self.switched = False  # a memory.kmem.tcp limit was written

    def back_home(self):
        if _libc.setns(self.host_netns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the host netns")

    def kill_procs(self):
        for c in self.clients:
            for p in c.procs:
                if p.poll() is None:
                    p.kill()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for c in self.clients:
            for p in c.procs:
                p.wait()
        for p in self.procs:
            p.wait()
        self.clients, self.procs = [], []

    def remove_cgroup(self, path):
        deadline = time.time() + 30
        while os.path.isdir(path):
            try:
                for pid in read(f"{path}/cgroup.procs").split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:  # uncharge what is left (page cache), so the cgroup can be freed
                    write(f"{path}/memory.force_empty", 0)
                except OSError:
                    pass
                os.rmdir(path)
            except OSError as e:
                if time.time() > deadline:
                    raise RuntimeError(f"cannot remove {path}: {e}")
                time.sleep(0.2)

    def cleanup(self):
        """Kills what was started, removes every netns and cgroup created;
        SIGINT/SIGTERM/SIGHUP wait until it is done. Returns the errors."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            return self._cleanup()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _cleanup(self):
        errors = []
        try:
            self.kill_procs()
        except Exception as e:  # noqa: BLE001 - keep cleaning
            errors.append(f"processes: {e}")
        for f in self.files:
            f.close()
        self.files = []
        try:
            self.back_home()
        except OSError as e:
            errors.append(str(e))
        for ns in self.netns:
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if r.returncode != 0 and ns in netns_list():
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        for cg in self.cgroups:
            try:
                self.remove_cgroup(cg)
            except RuntimeError as e:
                errors.append(str(e))
        self.netns, self.cgroups = [], []
        return errors


def netns_list():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftovers():
    cgs = [os.path.join(CGROUP_ROOT, d) for d in os.listdir(CGROUP_ROOT) if d.startswith(PREFIX)]
    nss = [n for n in netns_list() if n.startswith(PREFIX)]
    return cgs, nss


def remove_leftovers(host):
    cgs, nss = leftovers()
    if cgs or nss:
        log(f"removing leftovers of an earlier run: {cgs + nss}")
        host.cgroups, host.netns = cgs, nss
        errs = host.cleanup()
        if errs:
            fail("; ".join(errs))


def wait_tcp_quiet(baseline, timeout=30):
    """Waits until global TCP memory and sockets are back near the baseline
    (the previous mode's sockets freed), so modes do not overlap."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = sockstat()
        if s.get("mem", 0) <= baseline["mem"] + 256 and s.get("alloc", 0) <= baseline["alloc"] + 1000:
            return True
        time.sleep(0.25)
    return False


# --- one mode ------------------------------------------------------------------

def pod_usage(cg, accounted):
    u = read_int(f"{cg}/memory.usage_in_bytes")
    if accounted:
        u += read_int(f"{cg}/memory.kmem.tcp.usage_in_bytes")
    return u


def pod_peak(cg, accounted):
    u = read_int(f"{cg}/memory.max_usage_in_bytes")
    if accounted:
        u += read_int(f"{cg}/memory.kmem.tcp.max_usage_in_bytes")
    return u


def oom_kills(cg):
    for line in read(f"{cg}/memory.oom_control").splitlines():
        k, v = line.split()
        if k == "oom_kill":
            return int(v)
    return 0


def start_shard(host, args, name, limit, accounted, sysctls, server_args):
    """Creates the memory cgroup and netns `name`, moves this process into the
    netns, sets the namespaced sysctls there and starts c10m-server (echo,
    pinned to one CPU) inside the cgroup. Returns (cgroup, server, its log,
    sysctls applied, sysctls not applied)."""
    cg = os.path.join(CGROUP_ROOT, name)
    os.mkdir(cg)
    host.cgroups.append(cg)
    if limit:
        write(f"{cg}/memory.limit_in_bytes", limit)
    if accounted:
        host.switched = True
        write(f"{cg}/memory.kmem.tcp.limit_in_bytes", TCP_LIMIT)
    subprocess.run(["ip", "netns", "add", name], check=True)
    host.netns.append(name)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    setns(f"/var/run/netns/{name}")

    applied, not_applied = {}, {}
    for key, value in sorted(sysctls.items()):
        path = "/proc/sys/" + key.replace(".", "/")
        if key.startswith("net.") and os.path.exists(path):
            try:
                write(path, value)
                applied[key] = " ".join(read(path).split())
                if applied[key] != " ".join(str(value).split()):
                    not_applied[key] = {"plan": value, "netns": applied.pop(key)}
                continue
            except OSError:
                pass
        # node-level: read from the host's view, never written
        host.back_home()
        try:
            hv = " ".join(read(path).split()) if os.path.exists(path) else None
        finally:
            setns(f"/var/run/netns/{name}")
        not_applied[key] = {"plan": value, "host": hv}

    server_cpu = sorted(os.sched_getaffinity(0))[-1]

    def enter_shard():
        write(f"{cg}/cgroup.procs", os.getpid())
        os.sched_setaffinity(0, {server_cpu})

    cmd = [os.path.join(args.release, "c10m-server"), "--bind", "127.0.0.1",
           "--port", str(SERVER_PORT), "--metrics-port", str(METRICS_PORT),
           "--protocol", "echo"] + server_args
    server_log = tempfile.TemporaryFile(mode="w+")  # closed by cleanup: its pages leave the cgroup
    host.files.append(server_log)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=server_log,
                              env={**os.environ, "RUST_LOG": "warn"}, preexec_fn=enter_shard)
    host.procs.append(server)
    deadline = time.time() + 10
    while True:
        try:
            metrics()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server_log.seek(0)
                fail(f"c10m-server did not come up ({server.poll()}):\n{server_log.read()[-2000:]}")
            time.sleep(0.05)
    return cg, server, server_log, applied, not_applied


def probe_socket_accounting(host, args, n=PROBE_CONNECTIONS):
    """Bytes one idle connection charges to a fresh memory cgroup on which
    nothing writes memory.kmem.tcp.*: about 1.5 KB while socket accounting
    is off host-wide, about 2.4 KB more (the tcp_sock) while it is on. Run
    before the modes and after cleanup: the two must agree, else a removed
    cgroup still holds the switch on. This process connects (n < its
    RLIMIT_NOFILE)."""
    name = f"{PREFIX}-probe"
    try:
        cg, server, _, _, _ = start_shard(host, args, name, None, False, {}, ["--workers", "1"])
        time.sleep(0.3)
        u0 = read_int(f"{cg}/memory.usage_in_bytes")
        socks = []
        for i in range(n):
            s = socket.socket()
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((f"127.0.1.{1 + i % 8}", 0))
            s.connect(("127.0.0.1", SERVER_PORT))
            socks.append(s)
        deadline = time.time() + 10
        while live(server) < n and time.time() < deadline:
            time.sleep(0.02)
        held = live(server)
        time.sleep(0.3)
        u1 = read_int(f"{cg}/memory.usage_in_bytes")
        for s in socks:
            s.close()
        if held < n:
            raise RuntimeError(f"socket accounting probe: the server holds {held} of {n}")
        return round((u1 - u0) / n, 1)
    finally:
        errors = host.cleanup()
        if errors:
            raise RuntimeError("; ".join(errors))


def run_mode(host, args, mode, spec, plan, tcp_pressure, script):
    accounted = mode == "socketAccounted"
    name = f"{PREFIX}-{mode}"
    cap = plan["shardConnectionLimit"]
    slow_n = plan["slowReadersPerShard"]
    idle_n = cap - slow_n
    limit = plan["memoryLimitBytes"]
    log(f"== {mode}: cap {cap} = {idle_n} idle + {slow_n} slow readers, "
        f"memory limit {limit} B, nofile {plan['nofile']}")

    cg, server, server_log, applied, not_applied = start_shard(
        host, args, name, limit, accounted, plan["sysctls"],
        ["--workers", str(plan["workers"]), "--max-connections", str(cap),
         "--nofile", str(plan["nofile"]), "--backlog", str(plan.get("listenBacklog", 65535))])

    nclients = max(MIN_CLIENTS, math.ceil(cap / PER_CLIENT))
    clients = Clients(nclients, script)
    host.clients.append(clients)
    time.sleep(0.5)
    peak_tcp = [sockstat()["mem"]]

    def sample():
        peak_tcp[0] = max(peak_tcp[0], sockstat()["mem"])

    usage0, rss0 = pod_usage(cg, accounted), rss_bytes(server.pid)

    # 1. idle connections
    cpu0 = cpu_seconds(server.pid)
    t_send = time.monotonic()
    clients.send([{"cmd": "idle", "n": n} for n in split(idle_n, nclients)])
    replies, seen, t_all = [None] * nclients, 0, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select(clients.pending(), [], [], 0.005)
        for f in ready:
            i = [p.stdout for p in clients.procs].index(f)
            replies[i] = json.loads(f.readline())
        sample()
        if server.poll() is not None:
            break
        seen = live(server)
        if seen >= idle_n:
            t_all = time.monotonic()
            break
        if all(replies) and time.monotonic() - max(r["lastConnect"] for r in replies) > 3:
            break
    for i, p in enumerate(clients.procs):
        if replies[i] is None:
            replies[i] = clients._read(p, 120)
    connect_errors = sum(r["errors"] for r in replies)
    first = min((r["firstConnect"] for r in replies if r["firstConnect"]), default=t_send)
    accepts = round(idle_n / (t_all - first)) if t_all else None
    busy = round((cpu_seconds(server.pid) - cpu0) / (t_all - first), 2) if t_all else None
    time.sleep(1.0)
    sample()
    usage1, tcp1 = pod_usage(cg, accounted), sockstat()["mem"]
    rss1 = rss_bytes(server.pid) if server.poll() is None else rss0
    idle_seen = live(server)
    log(f"{mode}: {idle_seen} idle held, {accepts} accepts/s, pod +{usage1 - usage0} B, "
        f"connect errors {connect_errors}")

    # 2. slow readers
    clients.send([{"cmd": "slow", "n": n} for n in split(slow_n, nclients)])
    srep = clients.collect(300)
    connect_errors += sum(r["errors"] for r in srep)
    first_error = next((r["firstError"] for r in replies + srep if r["firstError"]), None)
    quiet, last_mem, settle_start = 0, None, time.monotonic()
    while time.monotonic() - settle_start < 60 and server.poll() is None:
        time.sleep(0.25)
        sent = sum(r["sent"] for r in clients.all({"cmd": "pump"}))
        mem = sockstat()["mem"]
        sample()
        steady = last_mem is not None and abs(mem - last_mem) <= max(8, last_mem // 200)
        quiet = quiet + 1 if sent == 0 and steady else 0
        last_mem = mem
        if quiet >= 3:
            break
    settled = quiet >= 3
    time.sleep(0.5)
    sample()
    alive = server.poll() is None
    usage2 = pod_usage(cg, accounted)
    rss2 = rss_bytes(server.pid) if alive else rss1
    tcp2 = sockstat()["mem"]
    skmem = ss_server_skmem(SERVER_PORT)
    unsent = sum(r["unsent"] for r in clients.all({"cmd": "pump"}))

    # 3. the end: what is held, what was charged
    held = clients.all({"cmd": "check"})
    client_held = sum(r["idle"] + r["slow"] for r in held)
    server_held = max(0, live(server))
    connections = min(client_held, server_held)
    peak = pod_peak(cg, accounted)
    failcnt = read_int(f"{cg}/memory.failcnt")
    kills = oom_kills(cg)
    tcp_failcnt = read_int(f"{cg}/memory.kmem.tcp.failcnt") if accounted else None

    pb = plan["podBytesPerConnection"]
    srb = plan["slowReaderBytes"]
    measured = (usage1 - usage0) / idle_n
    user = (rss1 - rss0) / idle_n
    # Beyond an idle connection, as the plan's slowReaderBytes is: minus the
    # idle figures just measured (idle sockets hold no buffer pages, so the
    # skmem and sockstat figures need no such correction).
    slow_pod = (usage2 - usage1) / slow_n - measured if slow_n else None
    slow_user = (rss2 - rss1) / slow_n - user if slow_n else None
    # What the plan charges the pod for one: the user part, and the kernel
    # part only where sockets are charged to the pod (cgroup v2).
    slow_pod_predicted = srb["user"] + (srb["kernel"] if accounted else 0)
    server_kernel_slow = (skmem["r"] + skmem["w"] + skmem["f"]) / slow_n if slow_n else None
    row = {
        "mode": mode,
        "connections": connections,
        "shardConnectionLimit": cap,
        "slowReaders": slow_n,
        "predictedPodBytesPerConnection": pb["total"],
        "measuredPodBytesPerConnection": round(measured, 1),
        "peakUsageOverLimit": round(peak / limit, 4),
        "failcnt": failcnt,
        "oomKills": kills,
        "tcpMemPagesOverPressure": round(peak_tcp[0] / tcp_pressure, 4),
        # extras
        "allHeld": connections == cap,
        "serverAlive": alive,
        "plannedCgroupMode": spec["node"]["cgroupMode"],
        "declaredConnections": spec["connections"],
        "memoryLimitBytes": limit,
        "podBytesBeforeClients": usage0,
        "plannedProcessBytes": plan.get("processBytes"),
        "nofile": plan["nofile"],
        "heldByClients": client_held,
        "heldByServerMetrics": server_held,
        "connectErrors": connect_errors,
        "predictedPodBytesPerConnectionUser": pb["user"],
        "predictedPodBytesPerConnectionKernel": pb["kernel"],
        "measuredPodBytesPerConnectionUser": round(user, 1),
        "measuredPodBytesPerConnectionKernel": round(measured - user, 1),
        "idleMeasuredOverPredicted": round(measured / pb["total"], 3) if pb["total"] else None,
        "acceptsPerSecond": accepts,
        "serverCpuBusyDuringFill": busy,
        "predictedSlowReaderBytes": srb["total"],
        "predictedSlowReaderBytesUser": srb["user"],
        "predictedSlowReaderBytesKernel": srb["kernel"],
        "predictedSlowReaderPodBytes": slow_pod_predicted,
        "measuredSlowReaderPodBytes": round(slow_pod, 1) if slow_n else None,
        "measuredSlowReaderUserBytes": round(slow_user, 1) if slow_n else None,
        "measuredSlowReaderKernelBytes": round(server_kernel_slow, 1) if slow_n else None,
        "measuredSlowReaderKernelParts": {k: round(skmem[k] / slow_n, 1) for k in ("r", "w", "f")}
        if slow_n else None,
        "measuredSlowReaderSockstatBytes": round((tcp2 - tcp1) * PAGE / slow_n, 1) if slow_n else None,
        "slowReadersSettled": settled,
        "slowReaderBytesUnsentByClients": unsent,
        "peakPodBytes": peak,
        "tcpMemPeakPages": peak_tcp[0],
        "sysctlsApplied": applied,
        "sysctlsNotApplied": not_applied,
    }
    if accounted:
        row["kmemTcpFailcnt"] = tcp_failcnt
    if first_error:
        row["firstConnectError"] = first_error
    if not alive:
        server_log.seek(0)
        row["serverExit"] = server.poll()
        row["serverLogTail"] = server_log.read()[-1000:]
    return row


# --- main ----------------------------------------------------------------------

def check_released(host, args, probe, errors):
    """The removed cgroups are freed, and the socket accounting the
    socketAccounted one switched on goes off, once their last sockets and
    pages are gone: probes again (up to 30 s) until it agrees with the start."""
    for _ in range(6):
        probe["after"] = probe_socket_accounting(host, args)
        probe["released"] = probe["after"] < probe["before"] + SOCK_HALF
        if probe["released"]:
            break
        time.sleep(5)
    log(f"socket accounting probe after: {probe['after']} B per connection")
    if not probe["released"]:
        errors.append(
            f"socket accounting still on after cleanup: a fresh cgroup is charged {probe['after']} B "
            f"per connection, {probe['before']} B before the run (a removed cgroup with a "
            "memory.kmem.tcp limit is not freed yet)")


def targets_of(rows):
    t = {
        "noOomKills": all(r["oomKills"] == 0 and r["serverAlive"] for r in rows),
        "failcntZero": all(r["failcnt"] == 0 for r in rows),
        "peakUsageWithinLimit": all(r["peakUsageOverLimit"] <= 1 for r in rows),
        "tcpMemBelowPressure": all(r["tcpMemPagesOverPressure"] < 1 for r in rows),
    }
    for r in rows:
        ratio = r["idleMeasuredOverPredicted"]
        t[f"idlePodBytesWithin10Percent_{r['mode']}"] = ratio is not None and 0.9 <= ratio <= 1.1
    return t


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        client_main(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", default=os.path.join(ROOT, "target/release"))
    ap.add_argument("--operator", default=None, help="default: RELEASE/c10m-operator")
    ap.add_argument("--out", default=os.path.join(ROOT, "target/bench/fidelity.json"))
    args = ap.parse_args()
    operator = args.operator or os.path.join(args.release, "c10m-operator")
    if os.geteuid() != 0:
        fail("needs root (memory cgroups, network namespaces)")
    if not os.path.exists(f"{CGROUP_ROOT}/memory.kmem.tcp.limit_in_bytes"):
        fail(f"needs the cgroup v1 memory controller at {CGROUP_ROOT} with kmem.tcp files")
    for b in (operator, os.path.join(args.release, "c10m-server")):
        if not os.access(b, os.X_OK):
            fail(f"{b} not found: cargo build --release -p c10m-server -p c10m-operator")

    load0 = [round(x, 2) for x in os.getloadavg()]
    plans = [(mode, *plan_for(operator, cg)) for mode, cg in MODES]
    # Page cache of the binary is charged to whoever reads it first: read it
    # here, outside the shard's cgroup, so no page of it keeps a removed
    # cgroup (and the socket accounting it switched on) alive.
    with open(os.path.join(args.release, "c10m-server"), "rb") as f:
        while f.read(1 << 20):
            pass
    host_tcp_mem = [int(x) for x in read("/proc/sys/net/ipv4/tcp_mem").split()]

    def on_signal(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    for s in SIGNALS:
        signal.signal(s, on_signal)
    host = Host()
    rows, error, cleanup_errors = [], None, []
    probe = {"before": None, "after": None, "released": None}
    try:
        remove_leftovers(host)
        probe["before"] = probe_socket_accounting(host, args)
        log(f"socket accounting probe before: {probe['before']} B per connection")
        if probe["before"] >= TCP_SOCK_BYTES:
            fail(f"socket accounting is already on host-wide: a fresh cgroup is charged "
                 f"{probe['before']} B per idle connection, at least a tcp_sock ({TCP_SOCK_BYTES} B). "
                 "Some v1 memory cgroup has memory.kmem.tcp.limit_in_bytes written (or a removed one "
                 "is not freed yet), so a v1 row would not measure v1; remove it and retry")
        base = sockstat()
        for mode, spec, plan in plans:
            if not wait_tcp_quiet(base):
                log(f"warning: TCP memory did not return to {base} before {mode}")
            try:
                rows.append(run_mode(host, args, mode, spec, plan, host_tcp_mem[1], os.path.abspath(__file__)))
            finally:
                cleanup_errors += host.cleanup()
        check_released(host, args, probe, cleanup_errors)
    except Interrupted as e:
        error = f"interrupted by {e}"
    except (Exception, SystemExit) as e:  # noqa: BLE001 - report after cleanup
        error = str(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
    finally:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        cleanup_errors += host.cleanup()
    if error and host.switched and probe["before"] is not None and probe["after"] is None:
        try:  # stopped after switching socket accounting on: still check it is off
            check_released(host, args, probe, cleanup_errors)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            cleanup_errors.append(f"socket accounting probe after: {e}")
            cleanup_errors += host.cleanup()
    cgs, nss = leftovers()
    if cgs or nss:
        cleanup_errors.append(f"still present after cleanup: {cgs + nss}")

    if error and not rows:
        print(f"fidelity: {error}", file=sys.stderr)
        for e in cleanup_errors:
            print(f"fidelity: cleanup: {e}", file=sys.stderr)
        sys.exit(1)
    targets = targets_of(rows)
    accepts = [r["acceptsPerSecond"] for r in rows if r["acceptsPerSecond"]]
    doc = {
        "command": "make bench-fidelity",
        "machine": {"cpus": len(os.sched_getaffinity(0)), "kernel": os.uname().release,
                "loadAverageAtStart": load0,
                    "memTotalBytes": mem_total(), "tcpMemPages": host_tcp_mem},
        "operator": operator,
        "rows": rows,
        "acceptsPerSecondPerWorker": min(accepts) if accepts else None,
        "targets": targets,
        "notes": [
            "socketAccounted: socket accounting switched on by writing memory.kmem.tcp.limit_in_bytes "
            "on the shard's v1 cgroup (stands in for cgroup v2); v1 keeps TCP buffer pages in "
            "memory.kmem.tcp.usage_in_bytes, outside memory.limit_in_bytes, so pod bytes = "
            "memory.usage_in_bytes + memory.kmem.tcp.usage_in_bytes and peak = max_usage_in_bytes + "
            "kmem.tcp.max_usage_in_bytes; failcnt/OOM cannot see the buffer pages there.",
            "measuredPodBytesPerConnection: idle connections only; User = server VmRSS delta, Kernel = the rest.",
            "measuredSlowReaderKernelBytes: server-side sockets' skmem r+w+f (ss -tnm) per slow reader; "
            "measuredSlowReaderSockstatBytes: global sockstat TCP mem delta per slow reader, both ends "
            "(clients live in the same kernel).",
            "tcpMemPagesOverPressure: global sockstat TCP mem peak, client ends included, over the "
            "host's tcp_mem pressure.",
            "acceptsPerSecondPerWorker: min over modes of idle / (first connect -> /metrics reports "
            "all); 2 client processes share the 2 CPUs with the server's pinned worker, and loopback "
            "runs handshakes in the connecting side's context.",
        ],
        "socketAccountingProbe": probe,
        "cleanup": {"leftovers": cgs + nss, "errors": cleanup_errors},
    }
    if error:
        doc["error"] = error
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(json.dumps(doc, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    bad = [k for k, v in targets.items() if not v]
    short = [r["mode"] for r in rows if not r["allHeld"]]
    if short:
        print(f"fidelity: FAIL: fewer connections than the cap held in {short}", file=sys.stderr)
    if bad:
        print(f"fidelity: FAIL: targets missed: {bad}", file=sys.stderr)
    if error or cleanup_errors or short or bad or len(rows) != len(MODES):
        sys.exit(1)


if __name__ == "__main__":
    main()
