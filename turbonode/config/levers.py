"""[levers]: what the agent's levers change while a rule engages them (agent/levers/)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..cgroups import V2_WEIGHT_MAX, V2_WEIGHT_MIN
from ..memory_cgroups import IO_WEIGHT_MAX, IO_WEIGHT_MIN
from ..throttle_params import MAX_INTRA_OP_THREADS
from .checks import MAX_CPUS, in_range, opt

# The levers a rule may engage while it is active (agent/levers/): `cpu_share` favours the
# worker's cgroup over best-effort cgroups (CPU weight, optional quota); `worker_threads` lowers
# the worker's torch intra-op threads through its throttle; `memory_squeeze` holds the best-effort
# memory cgroups where they are, `memory_protect` keeps the worker's from reclaim (v2), `io_weight`
# favours the worker's io cgroup, `io_throttle` caps the best-effort cgroups' writes
# (agent/levers/memory.py, io.py). docs/agent.md, measured in docs/benchmarks.md.
LEVER_NAMES = ("cpu_share", "worker_threads", "memory_squeeze", "memory_protect", "io_weight", "io_throttle")
OOM_SCORE_ADJ = (-1000, 1000)  # /proc/PID/oom_score_adj's range
MAX_WRITE_LIMIT = 2**53  # levers.best_effort_write_bps / _iops (the kernel takes u64; TOML ints are exact to here)
# io_throttle's caps (docs/benchmarks.md, node SLO io cell)
BEST_EFFORT_WRITE_BPS = 32 << 20
BEST_EFFORT_WRITE_IOPS = 256


def string_list(v: Any) -> None:
    if not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"expected an array of non-empty strings, got {v!r}")


def device_list(v: Any) -> None:
    """Block devices: "MAJ:MIN", a name or a /dev path each (turbonode/block_devices.py resolves them)."""
    string_list(v)
    for x in v:
        if not re.fullmatch(r"\d+:\d+|(/dev/)?[\w.+-]+(/[\w.+-]+)*", x):
            raise ValueError(f"expected a block device as 'MAJ:MIN', a name or a /dev path, got {x!r}")


CPU_WEIGHT = in_range(V2_WEIGHT_MIN, V2_WEIGHT_MAX)  # cgroup v2 cpu.weight units (turbonode/cgroups.py)


@dataclass
class LeversConfig:
    state_file: str = opt(
        "", help="what the levers changed, put back at the next start after a crash ('': beside agent.socket)"
    )
    cgroup_root: str = opt("/sys/fs/cgroup", help="cgroup filesystem root (the host's, in a container)")
    worker_cgroup: str = opt(
        "auto",
        help="the worker's cgroup that cpu_share and io_weight favour, on a node without [workers] tables (each "
        "names its own): 'auto' (the worker's own, found from its pid), a path or systemd slice, '' (leave it alone)",
    )
    best_effort_cgroups: list[str] = opt(
        [], string_list, "cgroups or systemd slices of co-located batch work that cpu_share holds back"
    )
    worker_cpu_weight: int = opt(10000, CPU_WEIGHT, "cpu.weight (v2 units) of every worker's cgroup while engaged")
    best_effort_cpu_weight: int = opt(1, CPU_WEIGHT, "cpu.weight (v2 units) of each best-effort cgroup while engaged")
    best_effort_cpus: float = opt(
        0.0, in_range(0, MAX_CPUS), "CPU cap of each best-effort cgroup while engaged (0: none)"
    )
    quota_neighbour_share: float = opt(
        0.1,
        in_range(0, 1),
        "while cpu_share is engaged, cap each cgroup that shares a worker's CPU quota (its nearest ancestor's) "
        "at this share of that quota (0: leave them)",
    )
    worker_threads: int = opt(
        1, in_range(1, MAX_INTRA_OP_THREADS), "torch intra-op threads of the worker while worker_threads is engaged"
    )
    memory_worker_cgroup: str = opt(
        "auto",
        help="the workers' memory cgroup that memory_protect protects: 'auto' (each worker's own), a path or slice, ''",
    )
    memory_best_effort_cgroups: list[str] = opt(
        [],
        string_list,
        "memory cgroups of batch work that memory_squeeze holds and oom_guard offers the OOM killer "
        "([]: levers.best_effort_cgroups)",
    )
    oom_guard: bool = opt(
        True, help="while the agent runs: the worker's and its own oom_score_adj lowered, best-effort processes' raised"
    )
    worker_oom_score_adj: int = opt(-900, in_range(*OOM_SCORE_ADJ), "oom_score_adj of the worker and the agent")
    best_effort_oom_score_adj: int = opt(
        1000, in_range(*OOM_SCORE_ADJ), "oom_score_adj of the processes in the best-effort cgroups"
    )
    worker_io_weight: int = opt(
        1000, in_range(IO_WEIGHT_MIN, IO_WEIGHT_MAX), "io.weight (v2 units) of every worker's cgroup while engaged"
    )
    best_effort_io_weight: int = opt(
        1, in_range(IO_WEIGHT_MIN, IO_WEIGHT_MAX), "io.weight (v2 units) of each best-effort cgroup while engaged"
    )
    best_effort_write_bps: int = opt(
        BEST_EFFORT_WRITE_BPS,
        in_range(0, MAX_WRITE_LIMIT),
        "while io_throttle is engaged, each best-effort cgroup's writes per device in bytes/s (0: no byte cap)",
    )
    best_effort_write_iops: int = opt(
        BEST_EFFORT_WRITE_IOPS,
        in_range(0, MAX_WRITE_LIMIT),
        "while io_throttle is engaged, each best-effort cgroup's write requests per device a second (0: no cap)",
    )
    io_throttle_devices: list[str] = opt(
        [],
        device_list,
        "the disks io_throttle caps writes to: 'MAJ:MIN', names or /dev paths ([]: every disk a mounted "
        "filesystem lies on)",
    )
