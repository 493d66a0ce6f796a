"""Hand-built Ethernet frames for classifier tests and benchmarks, sent and counted with
AF_PACKET sockets inside a sandbox namespace (no scapy here: struct is enough)."""

from __future__ import annotations

import ipaddress
import socket
import struct
import time

from pyroute2.netns import create_socket

MAGIC = b"TNQOSTST"  # every test frame carries it, so the receiver counts only ours
ETH_P_ALL = 0x0003
DST_MAC = bytes.fromhex("020000000002")
SRC_MAC = bytes.fromhex("020000000001")


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def eth(ethertype: int, payload: bytes, vlan: int | None = None, tpid: int = 0x8100) -> bytes:
    tag = struct.pack("!HH", tpid, vlan) if vlan is not None else b""
    return DST_MAC + SRC_MAC + tag + struct.pack("!H", ethertype) + payload


def udp(payload: bytes = MAGIC) -> bytes:
    return struct.pack("!HHHH", 40000, 9, 8 + len(payload), 0) + payload


def ipv4(tos: int, src: str, dst: str, payload: bytes | None = None) -> bytes:
    payload = udp() if payload is None else payload
    hdr = struct.pack(
        "!BBHHHBBH4s4s", 0x45, tos, 20 + len(payload), 1, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst)
    )
    hdr = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
    return hdr + payload


def ipv6(tclass: int, src: str, dst: str, payload: bytes | None = None) -> bytes:
    payload = udp() if payload is None else payload
    first = (6 << 28) | (tclass << 20) | 0x12345  # version, traffic class, flow label
    return (
        struct.pack("!IHBB", first, len(payload), 17, 64)
        + ipaddress.IPv6Address(src).packed
        + ipaddress.IPv6Address(dst).packed
        + payload
    )


def frames(sb) -> dict[str, bytes]:
    """One frame per case, addressed inside the sandbox. DSCP<<2 is the TOS byte; ECN bits set
    on some to check that they are masked."""
    v4 = lambda tos: eth(0x0800, ipv4(tos, sb.server_ip, sb.client_ip))  # noqa: E731
    return {
        "ef": v4(46 << 2),
        "ef_ecn": v4(46 << 2 | 0b11),
        "af41": v4(34 << 2),
        "cs1": v4(8 << 2),
        "le": v4(1 << 2 | 0b01),
        "unmarked": v4(0),
        "ipv6_ef": eth(0x86DD, ipv6(46 << 2 | 0b10, sb.server_ip6, sb.client_ip6)),
        "ipv6_af41": eth(0x86DD, ipv6(34 << 2, sb.server_ip6, sb.client_ip6)),
        "ipv6_cs1": eth(0x86DD, ipv6(8 << 2, sb.server_ip6, sb.client_ip6)),
        "vlan_ef": eth(0x0800, ipv4(46 << 2, sb.server_ip, sb.client_ip), vlan=100),
        "8021ad_ef": eth(0x0800, ipv4(46 << 2, sb.server_ip, sb.client_ip), vlan=7, tpid=0x88A8),
        "truncated_ipv4": eth(0x0800, b"\x45\xb8" + MAGIC),  # 10 bytes of an IPv4 header
        "truncated_ipv6": eth(0x86DD, b"\x6b\x80" + MAGIC + b"\0" * 20),  # 30 of 40 bytes
        "bad_version": eth(0x0800, b"\x65\xb8" + ipv4(46 << 2, sb.server_ip, sb.client_ip)[2:]),
        "non_ip": eth(0x88B5, MAGIC * 4),  # IEEE local experimental type
        "runt": DST_MAC + SRC_MAC + b"\x08\x00" + MAGIC[:2],  # shorter than any header
    }


class Wire:
    """AF_PACKET sender on the node's device and receiver on the peer, both in the sandbox."""

    def __init__(self, sb):
        self.tx = create_socket(sb.server, socket.AF_PACKET, socket.SOCK_RAW, 0, flags=0)
        self.tx.bind((sb.dev, 0))
        self.rx = create_socket(sb.client, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL), flags=0)
        self.rx.bind((sb.peer_dev, 0))
        self.rx.settimeout(0.2)

    def send(self, frame: bytes, count: int) -> None:
        for _ in range(count):
            self.tx.send(frame)

    def received(self, frame: bytes, expect: int, timeout: float = 3.0) -> int:
        """How many copies of `frame` arrived on the peer (stops at `expect` or `timeout`)."""
        got, deadline = 0, time.monotonic() + timeout
        # The peer's receive path moves a VLAN tag out of the data (into skb metadata).
        untagged = frame[:12] + frame[16:] if frame[12:14] in (b"\x81\x00", b"\x88\xa8") else frame
        while got < expect and time.monotonic() < deadline:
            try:
                data = self.rx.recv(65536)
            except TimeoutError:
                continue
            if data == frame or data == untagged:
                got += 1
        return got

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
