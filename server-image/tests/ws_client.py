#!/usr/bin/env python3
"""Checks c10m-server's WebSocket mode with an independent client: the
`websockets` package from PyPI (tests/cluster/install-deps.sh installs it).

Usage: ws_client.py ws://HOST:PORT/ MAX_FRAME_BYTES
Prints one line per check; exits non-zero on the first failure.
"""
import asyncio
import sys

import websockets
from websockets.exceptions import ConnectionClosed


async def main(uri, max_frame):
    checks = 0

    def ok(what):
        nonlocal checks
        checks += 1
        print("ok", what, flush=True)

    async with websockets.connect(uri, compression=None, max_size=None) as ws:
        await ws.send("héllo wörld €")
        assert await ws.recv() == "héllo wörld €"
        ok("text echo (UTF-8)")
        await ws.send(bytes(range(256)) * 4)
        assert await ws.recv() == bytes(range(256)) * 4
        ok("binary echo (1 KiB)")
        big = b"x" * (max_frame - 10)
        await ws.send(big)
        assert await ws.recv() == big
        ok("binary echo just under the frame limit")
        await ws.send(["frag", "men", "ted €"])
        assert await ws.recv() == "fragmented €"
        ok("fragmented text reassembles")
        await ws.send([b"a" * 100, b"b" * 100])
        assert await ws.recv() == b"a" * 100 + b"b" * 100
        ok("fragmented binary reassembles")
        pong = await ws.ping(b"rtt")
        latency = await asyncio.wait_for(pong, 5)
        assert latency >= 0
        ok("ping answered with pong")
        for i in range(200):
            await ws.send(f"m{i}")
        for i in range(200):
            assert await ws.recv() == f"m{i}"
        ok("200 pipelined messages in order")
        await ws.close(code=1000, reason="done")
        assert ws.close_code == 1000, ws.close_code
        ok("close handshake echoes 1000")

    # Subprotocols (the server runs with --subprotocols chat): the first
    # offer on its list is chosen; an offer of none of them gets none.
    async with websockets.connect(
        uri, compression=None, subprotocols=["superchat", "chat"]
    ) as ws:
        assert ws.subprotocol == "chat", ws.subprotocol
        await ws.send("with chat")
        assert await ws.recv() == "with chat"
        ok("subprotocol negotiated (first acceptable offer)")

    # Oversize frame: the server fails the connection with 1009.
    async with websockets.connect(uri, compression=None, max_size=None) as ws:
        await ws.send(b"y" * (max_frame + 1))
        try:
            await asyncio.wait_for(ws.recv(), 5)
            raise AssertionError("oversize frame was echoed")
        except ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code == 1009, e
        ok("oversize frame closes with 1009")

    # Invalid UTF-8 in a text frame (sent raw, the client would refuse): 1007.
    async with websockets.connect(uri, compression=None) as ws:
        # Through the sans-I/O protocol object, which does not validate.
        async with ws.send_context():
            ws.protocol.send_text(b"ok\xff\xfe")
        try:
            await asyncio.wait_for(ws.recv(), 5)
            raise AssertionError("invalid UTF-8 was echoed")
        except ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code == 1007, e
        ok("invalid UTF-8 text closes with 1007")

    print(f"{checks} passed, 0 failed", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
