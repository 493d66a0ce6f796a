"""The `io_weight` lever: favour the workers' io cgroups over the best-effort ones while the node's io
stalls: io weight up for every worker (levers.worker_io_weight), down for the best-effort cgroups
(levers.best_effort_io_weight), in v2 units, on v2 (io.weight, io.bfq.weight) or v1
(blkio.bfq.weight), turbonode/memory_cgroups.IoHierarchy. Weights act only where the device is
scheduled by BFQ (or, on v2, io.cost is on): under mq-deadline or none, as the development VM's
disk is, they change nothing, which the node SLO's `io` cell shows (docs/benchmarks.md).
Written through the journal, like every lever. A worker whose cgroup is not found yet (not
answering) leaves the others raised and is looked for again while engaged (cgroup.WorkerCgroups).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from turbonode.config import LeversConfig
from turbonode.memory_cgroups import IoHierarchy

from .cgroup import WorkerCgroup, WorkerCgroups
from .journal import KnobWrites


class IoWeight:
    name = "io_weight"
    dry_run_note = "would raise the workers' io weight and lower the best-effort cgroups'"

    def __init__(self, cfg: LeversConfig, writes: KnobWrites, workers: Sequence[WorkerCgroup], procfs: str):
        self.cfg, self.writes = cfg, writes
        self.cgroups = WorkerCgroups(workers, procfs)

    def engage(self) -> dict[str, Any]:
        h = IoHierarchy.find(self.cfg.cgroup_root)
        found = self.cgroups.find(h)
        if not found and not self.cfg.best_effort_cgroups:
            raise self.cgroups.nothing_to_weigh("io cgroup")
        writes = []
        for cg in dict.fromkeys(found.values()):  # workers sharing a cgroup raise it once
            writes += h.weight_writes(cg, self.cfg.worker_io_weight)
        for cg in self.cfg.best_effort_cgroups:
            writes += h.weight_writes(cg, self.cfg.best_effort_io_weight)
        for path, value in writes:
            self.writes.set(path, value)
        return {
            "cgroup_version": h.version,
            "worker_cgroups": found,
            "best_effort": tuple(self.cfg.best_effort_cgroups),
            "unresolved": dict(self.cgroups.unresolved),
        }

    def stale(self) -> bool:
        return self.cgroups.stale()

    def release(self) -> list[str]:
        self.cgroups.forget()
        return self.writes.undo_all()
