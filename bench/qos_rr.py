"""Bounded TCP request/response pair for bench/qos_latency.py, run inside a sandbox netns.

    qos_rr.py server --tos 0xb8 --max-requests N --idle 30
        prints its port, serves one connection: each 8-byte request (!Q size) gets `size` bytes.
    qos_rr.py client HOST PORT --size 262144 --count N --gap 0.05 --deadline 30 --tos 0xb8
        prints one JSON object: {"seconds": [per-transfer time], "timeouts": n}

Both sockets carry the given TOS (EF by default), so the node's egress classifier sees it.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

REQ = struct.Struct("!Q")
CHUNK = 65536


def _tos(sock: socket.socket, tos: int) -> None:
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, n: int, buf: bytearray | None = None) -> int:
    view = memoryview(buf or bytearray(min(n, CHUNK)))
    got = 0
    while got < n:
        k = sock.recv_into(view[: min(len(view), n - got)])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return got


def server(args) -> int:
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("0.0.0.0", 0))
    lsock.listen(1)
    lsock.settimeout(args.idle)
    print(lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()
    conn.settimeout(args.idle)
    _tos(conn, args.tos)
    payload = memoryview(bytes(args.max_size))
    req = bytearray(REQ.size)
    for _ in range(args.max_requests):
        try:
            _recv_exact(conn, REQ.size, req)
        except (ConnectionError, TimeoutError):
            break
        size = min(REQ.unpack(req)[0], args.max_size)
        conn.sendall(payload[:size])
    conn.close()
    return 0


def client(args) -> int:
    sock = socket.socket()
    _tos(sock, args.tos)
    sock.settimeout(args.timeout)
    sock.connect((args.host, args.port))
    buf = bytearray(CHUNK)
    seconds, timeouts = [], 0
    end = time.monotonic() + args.deadline
    for _ in range(args.count):
        if time.monotonic() > end:
            break
        t0 = time.perf_counter()
        sock.sendall(REQ.pack(args.size))
        try:
            _recv_exact(sock, args.size, buf)
        except TimeoutError:
            timeouts += 1
            break  # the stream is out of step now; stop rather than mis-measure
        seconds.append(time.perf_counter() - t0)
        time.sleep(args.gap)
    sock.close()
    print(json.dumps({"seconds": seconds, "timeouts": timeouts}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--tos", type=lambda v: int(v, 0), default=0xB8)
    s.add_argument("--max-requests", type=int, default=1000)
    s.add_argument("--max-size", type=int, default=1 << 20)
    s.add_argument("--idle", type=float, default=30)
    c = sub.add_parser("client")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--tos", type=lambda v: int(v, 0), default=0xB8)
    c.add_argument("--size", type=int, default=256 * 1024)
    c.add_argument("--count", type=int, default=100)
    c.add_argument("--gap", type=float, default=0.05)
    c.add_argument("--deadline", type=float, default=30)
    c.add_argument("--timeout", type=float, default=5)
    args = p.parse_args(argv)
    return server(args) if args.mode == "server" else client(args)


if __name__ == "__main__":
    sys.exit(main())
