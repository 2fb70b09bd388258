#!/usr/bin/env python3
"""Measures a server's memory per idle connection and prints JSON.

The server is c10m-server, or goecho (tools/goecho: the goroutine-per-
connection Go server the calibration tests also measure on the real node),
told apart by the binary's name. Starts the binary on 127.0.0.1 (goecho with
GOMAXPROCS=2, as c10m-server gets 2 workers), records its RSS and the kernel's Slab
(/proc/meminfo), opens N idle echo connections from a child process (source
addresses 127.0.1.x with IP_BIND_ADDRESS_NO_PORT), waits until the server's
/metrics reports all N live, and reports:

  userBytesPerConnection   = RSS delta of the server process / N
  kernelBytesPerConnection = Slab delta / (2 N)  (client and server sockets
                             live in the same kernel; approximate)

Usage: idle_memory.py BINARY [N]   (N <= 19000: RLIMIT_NOFILE is 20,000 here)
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

IP_BIND_ADDRESS_NO_PORT = 24


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def slab_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Slab")


def live(metrics_port):
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    # c10m-server labels its gauge by worker; goecho has one, unlabelled.
    return sum(float(l.split()[-1]) for l in body.splitlines()
               if l.split("{")[0].split(" ")[0] == "c10m_connections")


def hold(port, n, ready_w):
    """Child: open n connections, signal, then hold them until stdin closes."""
    conns = []
    for i in range(n):
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((f"127.0.1.{1 + i // 20000}", 0))
        s.connect(("127.0.0.1", port))
        conns.append(s)
    os.write(ready_w, b"x")
    sys.stdin.read()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--hold":
        hold(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 19000
    port, mport = free_port(), free_port()
    name = os.path.basename(binary)
    if name == "goecho":
        argv = [binary]
        env = dict(os.environ, C10M_BIND="127.0.0.1", C10M_PORT=str(port), C10M_METRICS_PORT=str(mport), GOMAXPROCS="2")
    else:
        argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--metrics-port", str(mport), "--workers", "2"]
        env = None
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                live(mport)
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.3)
        rss0, slab0 = rss_bytes(server.pid), slab_bytes()
        r, w = os.pipe()
        client = subprocess.Popen([sys.executable, __file__, "--hold", str(port), str(n), str(w)], stdin=subprocess.PIPE, pass_fds=(w,))
        os.close(w)
        os.read(r, 1)
        for _ in range(200):
            if live(mport) >= n:
                break
            time.sleep(0.05)
        held = live(mport)
        time.sleep(0.5)
        rss1, slab1 = rss_bytes(server.pid), slab_bytes()
        client.stdin.close()
        client.wait()
    finally:
        server.terminate()
        server.wait()
    print(json.dumps({
        "server": name, "protocol": "echo", "workers": 2, "connections": int(held),
        "rssBeforeBytes": rss0, "rssAfterBytes": rss1,
        "userBytesPerConnection": round((rss1 - rss0) / n, 1),
        "kernelBytesPerConnection": round((slab1 - slab0) / (2 * n), 1),
    }))


if __name__ == "__main__":
    main()
