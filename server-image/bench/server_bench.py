#!/usr/bin/env python3
"""Side-by-side benchmark of c10m-server (`make bench-server`).

Measures, with the same load generator (c10m-loadgen, `tools/loadgen`, run
from target/release like the servers) and on the same
machine, four servers each run as PROCS SO_REUSEPORT processes on one port of
127.0.0.1, every process pinned to one CPU (process i on CPU i mod ncpu, as
a pod's cpuset would):

  c10m-server (echo)       target/release/c10m-server --workers 1
  tokio-naive (echo)       target/release/examples/tokio_naive
  floor (echo)             target/release/examples/floor
  c10m-server (websocket)  target/release/c10m-server --protocol websocket

For each: baseline RSS of the server processes and kernel slab usage, open N
idle connections (no rate limit: the ramp gives acceptRatePerSec), wait for
the load generator's `connected` event plus a settle pause, measure again,
then ping 1 % of the connections for HOLD seconds (rttP50/P99/P999), and
then ping again with only 1,000 connections (rttP99UsAt1k), from as many
load generator processes as the big run used. Each ping period is cut into
5 windows; rttP99Us and rttP99UsAt1k are the medians of the windows' p99s
(the whole-run figures are kept beside them).

  userBytesPerConnection   = sum of the servers' VmRSS delta / N
  kernelBytesPerConnection = /proc/slabinfo delta (active objects x object
                             size, all caches) / (2 N): client and server
                             sockets are the same kernel objects (TCP sock,
                             socket inode, file, dentry, epoll item) in the
                             same kernel, so half the delta is the server's
  totalBytesPerConnection  = user + kernel

Writes the JSON to --out and prints a table. Standard library only.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

# The ping period is cut into this many windows; the reported p99 is the
# median of the windows' p99s (robust to a burst of unrelated load on a
# shared machine); the whole-run p99 is kept as rttP99UsWholeRun.
WINDOWS = 5
# Connections per load generator process (RLIMIT_NOFILE is 20,000 here).
PER_PROCESS = 19_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def slab_active_bytes():
    total = 0
    with open("/proc/slabinfo") as f:
        for line in f:
            if line.startswith("slabinfo") or line.startswith("#"):
                continue
            p = line.split()
            total += int(p[1]) * int(p[3])
    return total


def meminfo_slab():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1]) * 1024
    return 0


def tcp_inuse():
    with open("/proc/net/sockstat") as f:
        for line in f:
            if line.startswith("TCP:"):
                p = line.split()
                return int(p[p.index("inuse") + 1])
    return 0


def wait_sockets_gone(baseline, timeout=30.0):
    """Waits until the previous run's sockets are closed and freed, so the
    next measurement does not overlap their teardown."""
    deadline = time.time() + timeout
    while time.time() < deadline and tcp_inuse() > baseline + 500:
        time.sleep(0.2)
    time.sleep(1.0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def start_servers(kind, procs, port, release):
    cpus = sorted(os.sched_getaffinity(0))
    servers = []
    for i in range(procs):
        if kind in ("c10m-echo", "c10m-websocket"):
            proto = "websocket" if kind == "c10m-websocket" else "echo"
            cmd = [f"{release}/c10m-server", "--bind", "127.0.0.1", "--port", str(port),
                   "--metrics-port", str(free_port()), "--workers", "1", "--protocol", proto]
        elif kind == "tokio-naive":
            cmd = [f"{release}/examples/tokio_naive", f"127.0.0.1:{port}"]
        else:
            cmd = [f"{release}/examples/floor", f"127.0.0.1:{port}"]
        cpu = cpus[i % len(cpus)]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "RUST_LOG": "warn"},
                             preexec_fn=lambda c=cpu: os.sched_setaffinity(0, {c}))
        servers.append(p)
    wait_port(port)
    time.sleep(0.5)
    return servers


def stop(servers):
    for p in servers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 30
    for p in servers:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def loadgen(release, port, n, protocol, settle, hold, ping_rate, per_process, on_connected=None):
    cmd = [f"{release}/c10m-loadgen", "--target", f"127.0.0.1:{port}", "-n", str(n),
           "--per-process", str(per_process),
           "--protocol", protocol, "--ping-fraction", "0.01", "--ping-rate", str(ping_rate),
           "--settle", str(settle), "--hold", str(hold), "--windows", str(WINDOWS), "--events"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    result, measured = None, None
    for line in p.stdout:
        ev = json.loads(line)
        if ev["event"] == "connected" and on_connected and measured is None:
            measured = on_connected(ev)
        elif ev["event"] == "result":
            result = ev
    p.wait()
    if p.returncode != 0 or result is None:
        raise RuntimeError(f"c10m-loadgen failed ({p.returncode})")
    return result, measured


def row(kind, args, release):
    name, protocol = {
        "c10m-echo": ("c10m-server", "echo"),
        "c10m-websocket": ("c10m-server", "websocket"),
        "tokio-naive": ("tokio-naive", "echo"),
        "floor": ("floor", "echo"),
    }[kind]
    port = free_port()
    print(f"\n== {name} ({protocol}): {args.procs} processes, {args.connections} connections", file=sys.stderr)
    servers = start_servers(kind, args.procs, port, release)
    try:
        pids = [s.pid for s in servers]
        wait_sockets_gone(args.inuse0)
        rss0 = sum(rss_bytes(p) for p in pids)
        slab0, mslab0 = slab_active_bytes(), meminfo_slab()

        def measure(ev):
            time.sleep(args.settle / 2)
            return {
                "open": ev["open"],
                "rss": sum(rss_bytes(p) for p in pids),
                "slab": slab_active_bytes(),
                "meminfoSlab": meminfo_slab(),
            }

        big, m = loadgen(release, port, args.connections, protocol, args.settle, args.hold,
                         args.ping_rate, PER_PROCESS, measure)
        if any(s.poll() is not None for s in servers):
            raise RuntimeError(f"{name}: a server process exited during the run")
        wait_sockets_gone(args.inuse0 + args.procs)
        # The same number of load generator processes as the big run, so
        # the only difference is how many idle connections exist.
        lg_procs = -(-args.connections // PER_PROCESS)
        small, _ = loadgen(release, port, 1000, protocol, 1, args.hold, args.ping_rate,
                           -(-1000 // lg_procs))
    finally:
        stop(servers)
    n = m["open"]
    user = (m["rss"] - rss0) / n
    kernel = (m["slab"] - slab0) / (2 * n)
    return {
        "name": name,
        "protocol": protocol,
        "processes": args.procs,
        "connections": n,
        "userBytesPerConnection": round(user, 1),
        "kernelBytesPerConnection": round(kernel, 1),
        "totalBytesPerConnection": round(user + kernel, 1),
        "rttP50Us": big["rttP50Us"],
        "rttP99Us": median(big["windowRttP99Us"]),
        "rttP999Us": big["rttP999Us"],
        "rttP99UsAt1k": median(small["windowRttP99Us"]),
        "rttP99UsWholeRun": big["rttP99Us"],
        "rttP99UsAt1kWholeRun": small["rttP99Us"],
        "windowRttP99Us": big["windowRttP99Us"],
        "windowRttP99UsAt1k": small["windowRttP99Us"],
        "acceptRatePerSec": round(big["connectRatePerSec"]),
        "connectErrors": big["connectErrors"] + small["connectErrors"],
        "pings": big["pongs"],
        "meminfoSlabBytesPerConnection": round((m["meminfoSlab"] - mslab0) / (2 * n), 1),
    }


def median(xs):
    xs = sorted(x for x in xs if x)
    return xs[len(xs) // 2] if xs else 0


def ratios(rows):
    by = {(r["name"], r["protocol"]): r for r in rows}
    echo, ws = by.get(("c10m-server", "echo")), by.get(("c10m-server", "websocket"))
    tokio, floor = by.get(("tokio-naive", "echo")), by.get(("floor", "echo"))
    out = {}
    if echo and floor:
        out["echoTotalVsFloor"] = round(echo["totalBytesPerConnection"] / floor["totalBytesPerConnection"], 3)
    if ws and floor:
        out["websocketTotalVsFloor"] = round(ws["totalBytesPerConnection"] / floor["totalBytesPerConnection"], 3)
    for label, r in (("echo", echo), ("websocket", ws)):
        if r and r["rttP99UsAt1k"]:
            out[f"{label}P99At150kVsAt1k"] = round(r["rttP99Us"] / r["rttP99UsAt1k"], 2)
    if tokio and echo:
        out["tokioNaiveTotalVsC10m"] = round(tokio["totalBytesPerConnection"] / echo["totalBytesPerConnection"], 2)
        if echo["userBytesPerConnection"] > 0:
            out["tokioNaiveUserVsC10m"] = round(tokio["userBytesPerConnection"] / echo["userBytesPerConnection"], 1)
    targets = {}
    if echo:
        targets["echoUserBytesAtMost64"] = echo["userBytesPerConnection"] <= 64
    if ws:
        targets["websocketUserBytesAtMost128"] = ws["userBytesPerConnection"] <= 128
    if "echoTotalVsFloor" in out:
        targets["echoTotalAtMost1.05xFloor"] = out["echoTotalVsFloor"] <= 1.05
    if "websocketTotalVsFloor" in out:
        targets["websocketTotalAtMost1.05xFloor"] = out["websocketTotalVsFloor"] <= 1.05
    for label in ("echo", "websocket"):
        k = f"{label}P99At150kVsAt1k"
        if k in out:
            targets[f"{label}P99AtMost2xAt1k"] = out[k] <= 2
    out["targetsMet"] = targets
    return out


def table(rows, rat):
    cols = ["name", "protocol", "processes", "connections", "userBytesPerConnection",
            "kernelBytesPerConnection", "totalBytesPerConnection", "rttP50Us", "rttP99Us",
            "rttP999Us", "rttP99UsAt1k", "acceptRatePerSec", "connectErrors"]
    short = ["server", "proto", "procs", "conns", "user B", "kernel B", "total B", "p50 us",
             "p99 us", "p99.9 us", "p99@1k us", "accept/s", "errors"]
    w = [max(len(s), *(len(str(r[c])) for r in rows)) for s, c in zip(short, cols)]
    lines = ["  ".join(s.rjust(x) for s, x in zip(short, w))]
    for r in rows:
        lines.append("  ".join(str(r[c]).rjust(x) for c, x in zip(cols, w)))
    lines.append("ratios: " + json.dumps(rat))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "target/bench/server.json"))
    ap.add_argument("--release", default=os.path.join(ROOT, "target/release"))
    ap.add_argument("--connections", type=int, default=150_000)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--settle", type=float, default=4.0)
    ap.add_argument("--hold", type=float, default=8.0)
    ap.add_argument("--ping-rate", type=float, default=2000.0)
    ap.add_argument("--only", nargs="*", default=["c10m-echo", "tokio-naive", "floor", "c10m-websocket"])
    args = ap.parse_args()
    args.inuse0 = tcp_inuse()
    rows = [row(kind, args, args.release) for kind in args.only]
    rat = ratios(rows)
    doc = {
        "command": "make bench-server",
        "machine": {"cpus": len(os.sched_getaffinity(0)), "kernel": os.uname().release},
        "servers": rows,
        "ratios": rat,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(table(rows, rat))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
