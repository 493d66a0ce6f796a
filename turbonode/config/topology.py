"""The node's workers: [worker] and the [workers.<name>] tables resolved into one WorkerSpec per
worker (what the agent watches, what each worker instance serves), and the checks that they
can all run on one node.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..cgroups import parse_cpu_list
from ..errors import ConfigError
from .checks import split_host_port
from .file import Config
from .worker import WEIGHT_PORT_OFFSET, WorkerConfig

# The one worker of a node whose file names none ([workers] absent): [worker] and agent.worker_socket.
DEFAULT_WORKER = "default"


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of the node with every '' of its table resolved: what the agent watches and
    throttles, and what `turboctl worker run --instance NAME` serves."""

    name: str
    control_socket: str
    listen: str
    gpus: tuple[int, ...] | None  # NVML indexes it renders on; None: every GPU (a node naming no workers)
    device: str
    cgroup: str  # levers.worker_cgroup's forms
    cpus: frozenset[int]  # empty: any
    weight_port: int = 0  # worker.weight_port's forms


def instance_socket(base: str, name: str) -> str:
    """/run/turbonode/worker.sock -> /run/turbonode/worker-<name>.sock"""
    root, ext = os.path.splitext(base)
    return f"{root}-{name}{ext}"


def node_workers(cfg: Config) -> list[WorkerSpec]:
    """The node's workers, in the file's order; without [workers] tables the single `default` one
    (agent.worker_socket, worker.listen, worker.device, levers.worker_cgroup, every GPU)."""
    w = cfg.worker
    if not cfg.workers:
        return [
            WorkerSpec(
                DEFAULT_WORKER,
                cfg.agent.worker_socket,
                w.listen,
                None,
                w.device,
                cfg.levers.worker_cgroup,
                frozenset(),
                w.weight_port,
            )
        ]
    host, _, port = w.listen.rpartition(":")
    return [
        WorkerSpec(
            name,
            e.control_socket or instance_socket(w.control_socket, name),
            e.listen or f"{host}:{int(port) + i}",
            () if e.gpu < 0 else (e.gpu,),
            e.device or (f"cuda:{e.gpu}" if e.gpu >= 0 else w.device),
            e.cgroup,
            parse_cpu_list(e.cpus) if e.cpus else frozenset(),
            e.weight_port or (w.weight_port + i if w.weight_port > 0 else w.weight_port),
        )
        for i, (name, e) in enumerate(cfg.workers.items())
    ]


def instance_worker(cfg: Config, name: str | None) -> tuple[WorkerConfig, WorkerSpec]:
    """What worker `name` runs: [worker] with its socket, address and device (None: the node's only
    worker, which must then be unnamed). A name the file does not define is a ConfigError."""
    specs = {s.name: s for s in node_workers(cfg)}
    if name is None and cfg.workers:
        raise ConfigError("workers", f"this node names its workers ({', '.join(specs)}): name one")
    spec = specs.get(name or DEFAULT_WORKER)
    if spec is None:
        raise ConfigError(f"workers.{name}", f"no such worker (this node's: {', '.join(specs)})")
    if not cfg.workers:  # the node's only worker is [worker] as it is
        return cfg.worker, dataclasses.replace(spec, control_socket=cfg.worker.control_socket)
    return dataclasses.replace(
        cfg.worker,
        control_socket=spec.control_socket,
        listen=spec.listen,
        device=spec.device,
        weight_port=spec.weight_port,
    ), spec


def weight_address(listen: str, weight_port: int) -> tuple[str, int] | None:
    """Where a worker on `listen` answers HAProxy's agent-check (worker.weight_port's forms): None
    for -1; 0 is the HTTP port + WEIGHT_PORT_OFFSET, or 0 (ephemeral) with an ephemeral HTTP port."""
    if weight_port < 0:
        return None
    host, port = split_host_port(listen)
    if weight_port == 0:
        weight_port = port + WEIGHT_PORT_OFFSET if port else 0
    return host, weight_port


def check_workers(cfg: Config) -> None:
    """Workers that could not all run on one node: a shared socket, port or CPU; a key that names
    the single worker of a node that names several."""
    if not cfg.workers:
        return
    defaults = Config()
    for key, value, default in (
        ("agent.worker_socket", cfg.agent.worker_socket, defaults.agent.worker_socket),
        ("levers.worker_cgroup", cfg.levers.worker_cgroup, defaults.levers.worker_cgroup),
    ):
        if value != default:
            raise ConfigError(
                key, "names the single worker of a node without [workers]: set it in each [workers.<name>] table"
            )
    specs = node_workers(cfg)
    for i, spec in enumerate(specs):
        where = f"workers.{spec.name}"
        if not 0 < split_host_port(spec.listen)[1] < 65536:
            raise ConfigError(f"{where}.listen", f"port {spec.listen.rpartition(':')[2]} is out of range: set listen")
        for other in specs[:i]:
            if os.path.abspath(other.control_socket) == os.path.abspath(spec.control_socket):
                raise ConfigError(f"{where}.control_socket", f"{spec.control_socket} is workers.{other.name}'s too")
            if _same_port(spec.listen, other.listen):
                raise ConfigError(f"{where}.listen", f"{spec.listen} is workers.{other.name}'s too ({other.listen})")
            if spec.cpus & other.cpus:
                cpus = ",".join(map(str, sorted(spec.cpus & other.cpus)))
                raise ConfigError(f"{where}.cpus", f"CPUs {cpus} are workers.{other.name}'s too: each gets its own")


def _same_port(a: str, b: str) -> bool:
    """Two HOST:PORT addresses that cannot both be bound: one port, the same host or a wildcard."""
    (ha, pa), (hb, pb) = split_host_port(a), split_host_port(b)
    return pa == pb and (ha == hb or {"0.0.0.0", "::"} & {ha, hb} != set())


def check_weight_ports(cfg: Config) -> None:
    """Each worker's agent-check port in range and its own: no worker's HTTP port, no other's."""
    specs = node_workers(cfg)
    for i, spec in enumerate(specs):
        own = cfg.workers.get(spec.name)
        key = f"workers.{spec.name}.weight_port" if own is not None and own.weight_port else "worker.weight_port"
        address = weight_address(spec.listen, spec.weight_port)
        if address is None:
            continue
        host, port = address
        if port > 65535:
            raise ConfigError(key, f"port {port} (for the worker on {spec.listen}) is out of range: set {key}")
        if not port:
            continue
        taken = [(s.listen, f"{s.name}'s HTTP port") for s in specs] + [
            (f"{a[0]}:{a[1]}", f"{s.name}'s weight port")
            for s in specs[:i]
            if (a := weight_address(s.listen, s.weight_port)) is not None
        ]
        for other, what in taken:
            if _same_port(f"{host}:{port}", other):
                raise ConfigError(key, f"port {port} (for the worker on {spec.listen}) is worker {what} too")
