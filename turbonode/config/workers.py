"""[workers.<name>]: one table per worker of a multi-GPU node; turbonode/config/topology.py
resolves them into the node's workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .checks import cpu_list, empty_or, host_port, in_range, opt, torch_device
from .worker import WEIGHT_PORT_OFFSET

MAX_GPUS = 1024  # NVML indexes are below it ([workers.<name>] gpu)
# A worker's name is a systemd instance (turbonode-worker@<name>), part of a file name and a
# metric label value: letters, digits, '-' and '_'.
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


@dataclass
class WorkerEntry:
    """One worker of a multi-GPU node, `[workers.<name>]`: its name is its systemd instance
    (turbonode-worker@<name>), its `worker` metric label and turboctl's `--worker NAME`; every
    other [worker] key is shared by all of them. '' derives the value from the name (node_workers)."""

    control_socket: str = opt("", help="its control socket ('': worker.control_socket with -<name> before .sock)")
    listen: str = opt(
        "",
        empty_or(host_port),
        "its HTTP API ('': worker.listen's host and its port plus the worker's position among the tables)",
    )
    weight_port: int = opt(
        0,
        in_range(0, 65535),
        "its agent-check port (0: worker.weight_port plus the worker's position, or its HTTP port + "
        f"{WEIGHT_PORT_OFFSET} when worker.weight_port is 0)",
    )
    gpu: int = opt(
        -1,
        in_range(-1, MAX_GPUS - 1),
        "NVML index of its GPU (nvidia-smi's order; -1: none): the agent watches that GPU for it",
    )
    device: str = opt("", empty_or(torch_device), "its torch device ('': cuda:<gpu>, or worker.device without a gpu)")
    cgroup: str = opt(
        "auto",
        help="its cgroup, which cpu_share favours: 'auto' (its own, found from its pid), a path or systemd "
        "slice, '' (leave it alone)",
    )
    cpus: str = opt(
        "",
        empty_or(cpu_list),
        "the CPUs it runs on, e.g. '0-3' ('': any); its intra-op threads are sized to them",
    )
