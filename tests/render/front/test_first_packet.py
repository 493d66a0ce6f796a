"""A connection's first packet from the worker leaves in the handshake tier's class: the SYN-ACK's
TOS byte as it crosses the wire of a sandbox (two network namespaces joined by veth), with the
worker's listening socket (render.front.http_api.listening_socket) and, for comparison, without."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from turbonode.tiers import tos_byte

PORT = 8461

LISTEN = """
import sys
from render.front.http_api import listening_socket
sock = listening_socket(sys.argv[1], int(sys.argv[2]), sys.argv[3])
sock.setblocking(True)  # made for asyncio; this one waits
print("ready", flush=True)
conn, _ = sock.accept()
conn.recv(1)
"""

# Capture on the client's end of the veth, connect, print the TOS byte of the server's SYN-ACK.
CAPTURE = """
import socket, struct, sys
dev, server, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
raw.bind((dev, 0))
raw.settimeout(10)
conn = socket.create_connection((server, port), timeout=10)
while True:
    ip = raw.recv(2048)[14:]
    ihl = (ip[0] & 0x0F) * 4
    if ip[9] != socket.IPPROTO_TCP:
        continue
    sport = struct.unpack("!H", ip[ihl : ihl + 2])[0]
    if sport == port and ip[ihl + 13] & 0x12 == 0x12:  # SYN and ACK
        print(ip[1])
        break
conn.close()
"""


@pytest.mark.root
@pytest.mark.parametrize("tier", ["turbo", "relax", ""])
def test_the_syn_ack_carries_the_handshake_tiers_dscp(sandbox, tier):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = sandbox.popen(
        sandbox.server,
        sys.executable,
        "-c",
        LISTEN,
        sandbox.server_ip,
        str(PORT),
        tier,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        out = sandbox.run(
            sandbox.client, sys.executable, "-c", CAPTURE, sandbox.peer_dev, sandbox.server_ip, str(PORT), timeout=30
        )
        assert int(out.stdout) == (tos_byte(tier) if tier else 0)
    finally:
        server.kill()
        server.wait()
