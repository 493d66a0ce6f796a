"""The `io_weight` lever: favour the worker's io cgroup over the best-effort ones while the node's io
stalls: io weight up for the worker (levers.worker_io_weight), down for the best-effort cgroups
(levers.best_effort_io_weight), in v2 units, on v2 (io.weight, io.bfq.weight) or v1
(blkio.bfq.weight), turbonode/memory_cgroups.IoHierarchy. Weights act only where the device is
scheduled by BFQ (or, on v2, io.cost is on): under mq-deadline or none, as the development VM's
disk is, they change nothing, which the node SLO's `io` cell shows (docs/benchmarks.md).
Written through the journal, like every lever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turbonode.cgroups import CgroupError
from turbonode.config import LeversConfig
from turbonode.memory_cgroups import IoHierarchy

from .cgroup import worker_cgroup
from .journal import KnobWrites


class IoWeight:
    name = "io_weight"
    dry_run_note = "would raise the worker's io weight and lower the best-effort cgroups'"

    def __init__(self, cfg: LeversConfig, writes: KnobWrites, worker_pid: Callable[[], int | None], procfs: str):
        self.cfg, self.writes, self.worker_pid, self.procfs = cfg, writes, worker_pid, procfs

    def engage(self) -> dict[str, Any]:
        h = IoHierarchy.find(self.cfg.cgroup_root)
        worker = worker_cgroup(self.cfg.worker_cgroup, h, self.worker_pid, self.procfs)
        if worker is None and not self.cfg.best_effort_cgroups:
            raise CgroupError("nothing to weigh: no worker io cgroup and no levers.best_effort_cgroups")
        writes = h.weight_writes(worker, self.cfg.worker_io_weight) if worker is not None else []
        for cg in self.cfg.best_effort_cgroups:
            writes += h.weight_writes(cg, self.cfg.best_effort_io_weight)
        for path, value in writes:
            self.writes.set(path, value)
        return {
            "cgroup_version": h.version,
            "worker_cgroup": worker,
            "best_effort": tuple(self.cfg.best_effort_cgroups),
        }

    def release(self) -> list[str]:
        return self.writes.undo_all()
