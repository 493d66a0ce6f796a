"""The io levers.

`io_weight`: favour the workers' io cgroups over the best-effort ones while the node's io
stalls: io weight up for every worker (levers.worker_io_weight), down for the best-effort cgroups
(levers.best_effort_io_weight), in v2 units, on v2 (io.weight, io.bfq.weight) or v1
(blkio.bfq.weight), turbonode/memory_cgroups.IoHierarchy. Weights act only where the device is
scheduled by BFQ (or, on v2, io.cost is on): under mq-deadline or none, as the development VM's
disk is, they change nothing, which the node SLO's `io` cell shows (docs/benchmarks.md).
A worker whose cgroup is not found yet (not answering) leaves the others raised and is looked
for again while engaged (cgroup.WorkerCgroups).

`io_throttle`: cap each best-effort cgroup's writes, per disk (levers.io_throttle_devices, by
default every disk a mounted filesystem lies on), at levers.best_effort_write_bps bytes and
best_effort_write_iops requests a second while the node's io stalls: io.max on v2,
blkio.throttle.write_*_device on v1 (blk-throttle, which acts under any io scheduler, mq-deadline
included). On v1 it reaches what the job's tasks submit themselves (direct io, the writeback
their fsyncs start: a checkpointing job's), not the flusher's background writeback of their
dirty pages. A throttled writer waits in io, which is the node's io stall: the rule stays active
while the job writes, and lets go once it stops (turbonode/memory_cgroups.py).

Both are written through the journal, like every lever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from turbonode import block_devices
from turbonode.cgroups import CgroupError
from turbonode.config import LeversConfig
from turbonode.memory_cgroups import IoHierarchy

from .cgroup import WorkerCgroup, WorkerCgroups
from .journal import KnobError, KnobWrites


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


class IoThrottle:
    name = "io_throttle"
    dry_run_note = "would cap the best-effort cgroups' writes"

    def __init__(self, cfg: LeversConfig, writes: KnobWrites, procfs: str = "/proc", sysfs: str = "/sys"):
        self.cfg, self.writes, self.procfs, self.sysfs = cfg, writes, procfs, sysfs

    def devices(self) -> list[str]:
        """The disks to cap ("MAJ:MIN"), as levers.io_throttle_devices names them or, by default,
        those under the mounted filesystems."""
        if self.cfg.io_throttle_devices:
            return list(dict.fromkeys(block_devices.resolve(d, self.sysfs) for d in self.cfg.io_throttle_devices))
        return block_devices.mounted_disks(self.procfs, self.sysfs)

    def engage(self) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.best_effort_cgroups:
            raise CgroupError("no best-effort cgroups to throttle (levers.best_effort_cgroups)")
        if not cfg.best_effort_write_bps and not cfg.best_effort_write_iops:
            raise CgroupError("levers.best_effort_write_bps and best_effort_write_iops are both 0: nothing to cap")
        h = IoHierarchy.find(cfg.cgroup_root)
        devices = self.devices()
        if not devices:
            raise CgroupError("no disk to throttle: no mounted filesystem on one (levers.io_throttle_devices)")
        try:
            for cg in cfg.best_effort_cgroups:
                bps, iops = cfg.best_effort_write_bps, cfg.best_effort_write_iops
                for path, value, device, absent in h.throttle_writes(cg, devices, bps, iops):
                    self.writes.set(path, value, device, absent=absent)
        except (CgroupError, KnobError):
            self.writes.undo_all()  # none capped rather than some
            raise
        return {
            "cgroup_version": h.version,
            "devices": devices,
            "best_effort": tuple(cfg.best_effort_cgroups),
            "write_bps": cfg.best_effort_write_bps,
            "write_iops": cfg.best_effort_write_iops,
        }

    def stale(self) -> bool:
        return False  # no worker's cgroup to look for

    def release(self) -> list[str]:
        return self.writes.undo_all()
