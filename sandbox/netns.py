"""A sandbox node: two network namespaces joined by a veth pair; and a sandbox fleet: one
balancer namespace joined by a veth pair to each of several node namespaces.

Used by tests, benchmarks and `turboctl demo`. Addresses live in 10.254.0.0/16 and
fd00:254::/32 inside the namespaces only; nothing is routed out. Everything created is
deleted on exit, also when the body raises.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import uuid

from turbonode.errors import TurbonodeError

_counter = itertools.count()


class SandboxError(TurbonodeError):
    pass


def _tag() -> str:
    return f"{os.getpid() % 100000}{next(_counter)}{uuid.uuid4().hex[:3]}"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class Namespaces:
    """Network namespaces a sandbox created: run programs in them; delete them (and with them
    their veth ends, addresses and qdiscs) on exit, also when the body raises."""

    def __init__(self) -> None:
        self._created: list[str] = []

    def create(self) -> Namespaces:
        raise NotImplementedError

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def cmd(self, ns: str, *argv: str) -> list[str]:
        """argv to run a program inside namespace `ns`."""
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(ns, *argv), capture_output=True, text=True, timeout=timeout, check=check)

    def popen(self, ns: str, *argv: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(ns, *argv), **kw)

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()


class Sandbox(Namespaces):
    """`server` namespace (the node, device `dev`) and `client` namespace (device `peer_dev`)."""

    def __init__(self, prefix: str = "tn", subnet: int = 1):
        tag = _tag()
        self.server = f"{prefix}s{tag}"
        self.client = f"{prefix}c{tag}"
        self.dev = f"tns{tag}"[:15]
        self.peer_dev = f"tnc{tag}"[:15]
        self.server_ip = f"10.254.{subnet}.1"
        self.client_ip = f"10.254.{subnet}.2"
        self.server_ip6 = f"fd00:254:{subnet}::1"
        self.client_ip6 = f"fd00:254:{subnet}::2"
        super().__init__()

    def create(self) -> Sandbox:
        try:
            for ns in (self.server, self.client):
                self._add(ns)
            _ip(
                "-n",
                self.server,
                "link",
                "add",
                self.dev,
                "type",
                "veth",
                "peer",
                "name",
                self.peer_dev,
                "netns",
                self.client,
            )
            for ns, dev, v4, v6 in (
                (self.server, self.dev, self.server_ip, self.server_ip6),
                (self.client, self.peer_dev, self.client_ip, self.client_ip6),
            ):
                _ip("-n", ns, "addr", "add", f"{v4}/24", "dev", dev)
                _ip("-n", ns, "-6", "addr", "add", f"{v6}/64", "dev", dev, "nodad")
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.delete()
            raise
        return self


class Fleet(Namespaces):
    """Namespace `balancer` and one namespace per node, each joined to the balancer by a veth
    pair: node i is 10.254.<subnet + i>.2, the balancer's end 10.254.<subnet + i>.1."""

    def __init__(self, nodes: int = 2, subnet: int = 20):
        tag = _tag()
        self.balancer = f"tnb{tag}"
        self.nodes = [f"tn{i}{tag}" for i in range(nodes)]
        self.addresses = [f"10.254.{subnet + i}.2" for i in range(nodes)]
        self._devs = [(f"tnb{i}{tag}"[:15], f"tnn{i}{tag}"[:15]) for i in range(nodes)]
        super().__init__()

    def create(self) -> Fleet:
        try:
            for ns in (self.balancer, *self.nodes):
                self._add(ns)
            for ns, addr, (near, far) in zip(self.nodes, self.addresses, self._devs):
                _ip("-n", self.balancer, "link", "add", near, "type", "veth", "peer", "name", far, "netns", ns)
                _ip("-n", self.balancer, "addr", "add", addr.rpartition(".")[0] + ".1/24", "dev", near)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", far)
                _ip("-n", self.balancer, "link", "set", near, "up")
                _ip("-n", ns, "link", "set", far, "up")
        except BaseException:
            self.delete()
            raise
        return self
