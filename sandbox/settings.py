"""What a sandbox node runs: its link, its load, its fault and the worker's extra keys, shared by
`turboctl demo` (sandbox/demo.py), the node it builds (sandbox/node.py) and bench/node_slo.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DemoSettings:
    rate: str = "20mbit"  # the node's link, shaped in both phases
    duration: float = 20.0  # seconds of load per phase
    size: int = 256  # image size in pixels: big enough that the link matters
    turbo_rate: float = 1.0  # open-loop turbo requests per second (Poisson), as bench/node_slo.py sends them
    clients: dict = field(default_factory=lambda: {"fast": 1, "other": 1, "relax": 2})  # closed loop
    stress: bool = True  # the fault: stress-ng on every CPU during the load
    keep_logs: bool = False  # keep the daemons' logs (and the node's config) after the demo
    workers: int = 1  # the node's workers ([workers.<name>] a, b, ...; one: the node's `default`)
    worker_config: dict = field(default_factory=dict)  # more [worker] keys (turbonode.config.WorkerConfig)
    extra_toml: str = ""  # more tables for the node's configuration file, e.g. [policy]
    node_memory_mb: int = 0  # the node's RAM: its processes under a memory cgroup this large (0: none)
