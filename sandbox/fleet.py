"""A sandbox fleet: several sandbox nodes behind a real HAProxy, and their clients in front of it.

    client ns --veth-- front ns (HAProxy on :8460) --veth-- node ns 0 .. N-1

Each node is sandbox/node.py's DemoNode on its own namespace (`NodeLink`): the real worker, its
agent and HTB tree (or the plain FIFO), and its faults. A node's processes run in a cgroup of
the node's own with a CPU quota, the same for every node (`cpus`), so that nodes compete for
their own share and not for this machine's CPUs: the worker in `<node>/worker`, best-effort batch
work in `<node>/batch` (the agent's cpu_share lever lowers it), the agent in `<node>/agent`,
everything else the node runs (a fault's hog or bulk flows) in `<node>/other`. A worker that
exits is started again by DemoNode's supervisor, as its unit's Restart=on-failure would;
`wait_back` says when it answers.

HAProxy runs the shipped deploy/haproxy/turbonode.cfg with this fleet's addresses substituted
(`fleet_config`: each backend's first server line is the template of one line per node, and the
runtime socket lives in the fleet's directory), or `plain_config` of it: round-robin with TCP
checks, no retry but on a failed connect (HAProxy's default). `close` stops every process by
PID and removes the cgroups, the namespaces and the temporary directory, also when a step fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from turbonode.cgroups import CpuHierarchy
from turbonode.errors import ControlError
from turbonode.jsonrpc import ControlClient

from .interrupt import Closing
from .loadgen import Outcome
from .netns import Fleet, Sandbox, _ip
from .node import REQUEST_TIMEOUT_S, DemoError, DemoNode, _stop
from .settings import DemoSettings

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = ROOT / "deploy/haproxy/turbonode.cfg"
SHIPPED_STATS_SOCKET = "/run/haproxy/turbonode.sock"
BALANCER_PORT = 8460  # the shipped config's `bind :8460`
# The CFS period of a node's quota. A node of 0.5 CPU stands for a slower machine, not for one that
# stops for 50 ms in every 100 (the default period): with 100 ms, a 30 ms step either ran
# untouched or waited out the rest of the period, so a node's step times, and the weight judged by
# them, jumped with whatever else the node ran (its own HTTP work pushed a healthy node to 1.5x
# its usual pace). 10 ms quanta share the CPU about as evenly as a slower core would.
NODE_PERIOD_US = 10_000
# Lines of the shipped config a plain balancer does without: tier-aware health checks and retries
# of refused requests (HAProxy then checks TCP connects and retries only a failed connect).
PLAIN_DROPS = re.compile(r"^\s*(option httpchk|http-check |retry-on )")
# ... and the weights the workers answer (agent-check): a plain balancer weighs every server alike.
AGENT_OPTIONS = re.compile(r" agent-(check|port \S+|inter \S+)")
SERVER_LINE = re.compile(r"^(\s+)server \S+ \S+ id \d+ (.*)$")


class FleetNet(Fleet):
    """sandbox/netns.py's Fleet (the balancer's `front` namespace joined to each node's) plus a
    client namespace joined to the front: the client is 10.254.<client_subnet>.2, the front .1."""

    def __init__(self, nodes: int, subnet: int = 20, client_subnet: int = 19):
        super().__init__(nodes, subnet)
        self.client = f"{self.balancer}c"
        self.client_ip = f"10.254.{client_subnet}.2"
        self.front_ip = f"10.254.{client_subnet}.1"
        self._client_devs = (f"{self.balancer}f"[:15], f"{self.balancer}k"[:15])

    def create(self) -> FleetNet:
        super().create()
        try:
            near, far = self._client_devs
            self._add(self.client)
            _ip("-n", self.balancer, "link", "add", near, "type", "veth", "peer", "name", far, "netns", self.client)
            _ip("-n", self.balancer, "addr", "add", f"{self.front_ip}/24", "dev", near)
            _ip("-n", self.client, "addr", "add", f"{self.client_ip}/24", "dev", far)
            _ip("-n", self.balancer, "link", "set", near, "up")
            _ip("-n", self.client, "link", "set", far, "up")
        except BaseException:
            self.delete()
            raise
        return self

    def link(self, i: int) -> NodeLink:
        return NodeLink(self, i)


class NodeLink(Sandbox):
    """Node i of a FleetNet as a DemoNode sees its sandbox: `server` is the node, `client` the
    front (the node's peer: its images and a bulk fault's flows go there). The fleet owns the
    namespaces: create and delete do nothing."""

    def __init__(self, net: FleetNet, i: int):
        Sandbox.__init__(self)  # names of its own, unused: the fleet's replace them
        self.server, self.client = net.nodes[i], net.balancer
        self.peer_dev, self.dev = net._devs[i]
        self.server_ip = net.addresses[i]
        self.client_ip = net.addresses[i].rpartition(".")[0] + ".1"

    def create(self) -> NodeLink:
        return self

    def delete(self) -> None:
        pass


class FleetNode(DemoNode):
    """A DemoNode on a fleet's node namespace, in a cgroup of its own capped at `cpus`."""

    def __init__(self, settings: DemoSettings, link: NodeLink, name: str, cpus: float, log=print):
        super().__init__(settings, log, sandbox=link)
        self.name, self.cpus = name, cpus
        self.top_cgroup = f"/{link.server}-node"
        self.other_cgroup = self.node_cgroup("other")
        # the fleet's nodes share their peer (the front): a client cgroup of each node's own name
        self.client_cgroup = f"/{link.server}-client"

    def node_cgroup(self, role: str) -> str:
        """Inside the node's own cgroup, under its quota."""
        return f"/{self.sandbox.server}-node/{role}"

    # a fleet's node runs one worker (settings.workers = 1): the fleet balances over nodes
    @property
    def worker(self) -> subprocess.Popen:
        """Its worker's process now (a new one after each restart)."""
        proc = self.workers[0].proc
        if proc is None:
            raise DemoError(f"{self.name} is not started")
        return proc

    @property
    def worker_rpc(self) -> ControlClient:
        rpc = self.workers[0].rpc
        if rpc is None:
            raise DemoError(f"{self.name} is not started")
        return rpc

    @property
    def worker_cgroup(self) -> str:
        return self.workers[0].cgroup

    @property
    def address(self) -> str:
        return f"{self.sandbox.server_ip}:{self.workers[0].port}"

    def start(self) -> FleetNode:
        super().start()
        if self.cgroups is None:  # DemoNode.start carries on without cgroups; a fleet node cannot
            raise DemoError(f"{self.name} has no cgroup of its own: a fleet needs the cpu controller for its quotas")
        return self

    def _make_cgroups(self, cgroups: CpuHierarchy) -> None:
        """The node's cgroup with its quota and `other` and the agent's in it (apart from `other`:
        cpu_share caps the cgroups that share the worker's quota but never the agent's own, which
        would spare a hog beside it), then DemoNode's: the worker's and the batch cgroup (inside
        the node's here) and the load generator's (beside it)."""
        for cg in (self.top_cgroup, self.other_cgroup, self.agent_cgroup):
            cgroups.create(cg)
            self._made.append(cg)
        for path, value in cgroups.quota_writes(self.top_cgroup, self.cpus, NODE_PERIOD_US):
            Path(path).write_text(value)
        super()._make_cgroups(cgroups)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """The worker and the agent in their cgroups (DemoNode's spawn and the worker's argv move
        them there), anything else the node runs in `other`."""
        own = name in (self.log_name(self.workers[0]), "agent")
        return super().spawn(name, argv if own else self.in_cgroup(self.other_cgroup, argv))

    # ---- a worker's exit -----------------------------------------------------------------

    def kill_worker(self) -> float:
        """SIGKILL the worker's main process (its engine process follows); when, monotonic."""
        at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.worker.pid, signal.SIGKILL)
        return at

    def wait_back(self, exits: int, timeout: float) -> float | None:
        """When the worker answered again once it had exited `exits` times in all (DemoNode's
        supervisor starts it again), monotonic; None if not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.worker_exits) >= exits and self.worker.poll() is None:
                with contextlib.suppress(ControlError):
                    self.worker_rpc.call("ping")
                    return time.monotonic()
            time.sleep(0.2)
        return None


# ---- HAProxy -----------------------------------------------------------------------------


def fleet_config(text: str, servers: list[tuple[str, str]], stats_socket: str) -> str:
    """The shipped configuration `text` with the fleet's servers ((name, address:port) each) in
    every backend, one line each from the backend's first server line, and the runtime socket at
    `stats_socket`; nothing else changes."""
    if SHIPPED_STATS_SOCKET not in text:
        raise ValueError(f"the configuration has no stats socket at {SHIPPED_STATS_SOCKET}")
    out: list[str] = []
    templated = False  # this backend's servers are written
    for line in text.replace(SHIPPED_STATS_SOCKET, stats_socket).splitlines():
        if line.startswith(("backend ", "frontend ", "defaults", "global", "resolvers ")):
            templated = False
        m = SERVER_LINE.match(line)
        if m is None:
            out.append(line)
            continue
        if not templated:
            indent, options = m.groups()
            out += [f"{indent}server {name} {addr} id {i} {options}" for i, (name, addr) in enumerate(servers, 1)]
            templated = True
    if not any(SERVER_LINE.match(line) for line in out):
        raise ValueError("the configuration has no server line to take as a template")
    return "\n".join(out) + "\n"


def plain_config(text: str) -> str:
    """A plain balancer from a fleet config: round-robin, TCP checks, HAProxy's default retries, no
    agent-check weights."""
    lines = [AGENT_OPTIONS.sub("", line) for line in text.splitlines() if not PLAIN_DROPS.match(line)]
    return "\n".join(line.replace("balance leastconn", "balance roundrobin") for line in lines) + "\n"


def server_states(stats: Path) -> dict[tuple[str, str], str]:
    """(backend, server) -> status (UP, DOWN, MAINT ...), from HAProxy's runtime API at `stats`."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(stats))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out = {}
    for line in data.decode().splitlines():
        f = line.split(",")
        if len(f) > 17 and f[1] not in ("FRONTEND", "BACKEND", "svname"):
            out[(f[0], f[1])] = f[17]
    return out


def wait_state(stats: Path, want: dict[tuple[str, str], str], timeout: float) -> dict[tuple[str, str], str]:
    """Until every (backend, server) in `want` has a status starting with its value, or timeout:
    the last states seen."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            states = server_states(stats)
        except OSError:  # not listening yet
            states = {}
        if all(states.get(k, "").startswith(v) for k, v in want.items()) or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


class Balancer:
    """HAProxy in the fleet's front namespace, on a configuration in `work`; stopped by PID."""

    def __init__(self, net: FleetNet, work: Path, config: str):
        self.net, self.work = net, work
        self.stats = work / "haproxy.sock"
        self.config = work / "haproxy.cfg"
        self.config.write_text(config)
        self.log_path = work / "haproxy.log"
        self.proc: subprocess.Popen | None = None

    def check(self) -> None:
        res = subprocess.run(["haproxy", "-c", "-f", str(self.config)], capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise DemoError(f"haproxy -c refused {self.config}: {(res.stdout + res.stderr).strip()}")

    def start(self) -> Balancer:
        self.check()
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen(
                self.net.cmd(self.net.balancer, "haproxy", "-db", "-f", str(self.config)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def states(self) -> dict[tuple[str, str], str]:
        return server_states(self.stats)

    def wait(self, want: dict[tuple[str, str], str], timeout: float) -> dict[tuple[str, str], str]:
        return wait_state(self.stats, want, timeout)

    def weight(self, backend: str, server: str) -> int:
        """The server's current weight (what its agent-check last set) in percent of its configured
        one, from the runtime API."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.stats))
            s.sendall(f"get weight {backend}/{server}\n".encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        current, _, initial = data.decode().partition("(initial ")  # "<current> (initial <initial>)"
        return round(100 * int(current) / int(initial.rstrip(")\n ")))

    def retried(self) -> list[dict]:
        """Requests HAProxy logged with retries (httplog's retries field; '+' when redispatched):
        backend, server and the field, one dict each."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            m = re.search(r" (\S+)/(\S+) \S+ \d{3} .* \d+/\d+/\d+/\d+/(\+?\d+) ", line)
            if m and m.group(3) not in ("0", "+0"):
                out.append({"backend": m.group(1), "server": m.group(2), "retries": m.group(3)})
        return out


# ---- the fleet ---------------------------------------------------------------------------


@dataclass
class FleetSettings:
    nodes: int = 3
    cpus: float = 0.5  # each node's CPU quota, in CPUs
    node: DemoSettings = field(default_factory=DemoSettings)  # what each node runs (worker keys, link rate)
    plain_balancer: bool = False  # plain_config: round-robin, TCP checks


class SandboxFleet(Closing):
    """The namespaces, the nodes and HAProxy; `close` undoes all of it."""

    def __init__(self, settings: FleetSettings, log=print, node_class: type[FleetNode] = FleetNode):
        self.s, self.log, self.node_class = settings, log, node_class
        self.net = FleetNet(settings.nodes)
        self.work = Path(tempfile.mkdtemp(prefix=f"turbonode-fleet-{self.net.balancer}-"))
        self.nodes: list[FleetNode] = []
        self.balancer: Balancer | None = None

    def start(self) -> SandboxFleet:
        self.net.create()
        self.nodes = [
            self.node_class(self.s.node, self.net.link(i), f"node{i}", self.s.cpus, self.log)
            for i in range(self.s.nodes)
        ]
        with ThreadPoolExecutor(len(self.nodes)) as pool:  # the workers load at once
            started = [pool.submit(node.start) for node in self.nodes]
            for future in started:
                future.result()  # the first node that failed to start says why
        servers = [(node.name, node.address) for node in self.nodes]
        config = fleet_config(SHIPPED_CONFIG.read_text(), servers, str(self.work / "haproxy.sock"))
        self.balancer = Balancer(self.net, self.work, plain_config(config) if self.s.plain_balancer else config)
        self.balancer.start()
        up = {(backend, node.name): "UP" for backend in ("turbo", "workers") for node in self.nodes}
        states = self.balancer.wait(up, 30)
        if any(not states.get(k, "").startswith("UP") for k in up):
            raise DemoError(f"HAProxy does not see every node up: {states}")
        self.log(
            f"fleet: {len(self.nodes)} nodes of {self.s.cpus:g} CPU behind HAProxy at "
            f"http://{self.net.front_ip}:{BALANCER_PORT} (netns {self.net.balancer}); clients in {self.net.client}"
        )
        return self

    def close(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for node in self.nodes:
            try:
                node.close()
            except Exception as exc:  # noqa: BLE001 - the other nodes and the namespaces still go
                self.log(f"warning: closing {node.name}: {exc}")
        self.net.delete()
        if self.s.node.keep_logs:
            self.log(f"HAProxy's log and configuration kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"http://{self.net.front_ip}:{BALANCER_PORT}"

    def load(
        self,
        clients: dict[str, int],
        probes: int,
        rate: float,
        start_at: float,
        seed: int | None = None,
    ) -> list[Outcome]:
        """sandbox.loadgen in the client namespace through HAProxy, starting at `start_at` (monotonic)."""
        argv = [sys.executable, "-m", "sandbox.loadgen", self.url, "--size", str(self.s.node.size)]
        argv += ["--timeout", str(REQUEST_TIMEOUT_S), "--probes", str(probes), "--rate", str(rate)]
        argv += ["--start-at", str(start_at), *(f"--clients={t}={n}" for t, n in clients.items())]
        argv += ["--seed", str(seed)] if seed is not None else []
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        res = subprocess.run(
            self.net.cmd(self.net.client, *argv),
            env=env,
            capture_output=True,
            text=True,
            timeout=max(0.0, start_at - time.monotonic()) + probes / rate * 3 + REQUEST_TIMEOUT_S * 2,
        )
        if res.returncode != 0:
            raise DemoError(f"the load generator failed: {res.stderr.strip()[-2000:]}")
        return [Outcome(**o) for o in json.loads(res.stdout)]
