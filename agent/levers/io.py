"""The io levers.

`io_weight`: favour the workers' io cgroups over the best-effort ones while the node's io
stalls: io weight up for every worker (levers.worker_io_weight), down for the best-effort cgroups
(levers.best_effort_io_weight), in v2 units, on v2 (io.weight, io.bfq.weight) or v1
(blkio.bfq.weight), turbonode/memory_cgroups.IoHierarchy. Weights act only on a disk a
proportional policy schedules (BFQ, or on v2 io.cost): under mq-deadline or none, as the
development VM's disks and most NVMe hosts run, they change nothing (docs/benchmarks.md, `io`
cell), and on v1 without BFQ there is no weight file at all. So it weighs the disks that have such
a policy and, on the others, caps the best-effort cgroups' writes through io_throttle's writer
(IoThrottle.hold: one set of io.max / blk-throttle lines, shared, so the two levers never undo
each other's caps); where neither can be had it stays off and says why (agent/levers/io_policy.py;
status `actions.levers.io_weight.io_policy`, `turboctl doctor`, turbonode_lever_mode).
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

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from turbonode import block_devices
from turbonode.cgroups import CgroupError
from turbonode.config import LeversConfig
from turbonode.errors import TurbonodeError
from turbonode.memory_cgroups import IoHierarchy

from .cgroup import WorkerCgroup, WorkerCgroups
from .io_policy import OFF, IoPolicy, probe
from .journal import KnobError, KnobWrites

POLICY_TTL_S = 30.0  # how long a probe of the disks' schedulers stands for status (engaging probes afresh)


class NoIoControl(CgroupError):
    """Neither io weights nor write limits can be had here: io_weight stays off (not an agent error)."""


def throttle_devices(cfg: LeversConfig, procfs: str = "/proc", sysfs: str = "/sys") -> list[str]:
    """The disks the io levers act on ("MAJ:MIN"), as levers.io_throttle_devices names them or, by
    default, those under the mounted filesystems."""
    if cfg.io_throttle_devices:
        return list(dict.fromkeys(block_devices.resolve(d, sysfs) for d in cfg.io_throttle_devices))
    return block_devices.mounted_disks(procfs, sysfs)


Enables = Callable[[str], bool]  # the lever writer's `enables`: agent/levers/writers.py


def io_hierarchy(cfg: LeversConfig, enables: Enables | None = None) -> IoHierarchy:
    """The io hierarchy, knowing which knobs the writer's owner (systemd) brings into being."""
    return replace(IoHierarchy.find(cfg.cgroup_root), owner_enables=enables)


def node_io_policy(
    cfg: LeversConfig, procfs: str = "/proc", sysfs: str = "/sys", enables: Enables | None = None
) -> tuple[IoHierarchy, IoPolicy]:
    """The io hierarchy and what io_weight can do on the node's disks (io_policy.probe); raises
    TurbonodeError without an io controller or for a configured disk that does not exist."""
    h = io_hierarchy(cfg, enables)
    disks = throttle_devices(cfg, procfs, sysfs)
    return h, probe(h, disks, cfg.best_effort_cgroups, cfg.best_effort_write_bps, cfg.best_effort_write_iops, sysfs)


def io_policy_status(
    cfg: LeversConfig, procfs: str = "/proc", sysfs: str = "/sys", enables: Enables | None = None
) -> dict[str, Any]:
    """node_io_policy as status shows it (IoPolicy.as_dict); a probe that fails is `off`, with why."""
    try:
        return node_io_policy(cfg, procfs, sysfs, enables)[1].as_dict()
    except TurbonodeError as exc:
        return {"mode": OFF, "summary": str(exc)}


class IoWeight:
    name = "io_weight"
    dry_run_note = "would raise the workers' io weight and lower the best-effort cgroups'"

    def __init__(
        self,
        cfg: LeversConfig,
        writes: KnobWrites,
        workers: Sequence[WorkerCgroup],
        procfs: str,
        throttle: IoThrottle | None = None,
        sysfs: str = "/sys",
    ):
        """`throttle`: the io_throttle lever, whose writer caps the disks weights do nothing on."""
        self.cfg, self.writes, self.sysfs = cfg, writes, sysfs
        self.cgroups = WorkerCgroups(workers, procfs)
        self.throttle = throttle or IoThrottle(cfg, KnobWrites(writes.journal), procfs, sysfs)
        self._policy: tuple[float, dict[str, Any]] | None = None

    def probe(self) -> tuple[IoHierarchy, IoPolicy]:
        h, policy = node_io_policy(self.cfg, self.throttle.procfs, self.sysfs, self.throttle.enables)
        self._policy = (time.monotonic(), policy.as_dict())
        return h, policy

    def policy(self) -> dict[str, Any]:
        """What io_weight can do here (IoPolicy.as_dict), probed at most every POLICY_TTL_S."""
        if self._policy is None or time.monotonic() - self._policy[0] >= POLICY_TTL_S:
            status = io_policy_status(self.cfg, self.throttle.procfs, self.sysfs, self.throttle.enables)
            self._policy = (time.monotonic(), status)
        return self._policy[1]

    def engage(self) -> dict[str, Any]:
        h, policy = self.probe()
        found = self.cgroups.find(h)
        if not found and not self.cfg.best_effort_cgroups:
            raise self.cgroups.nothing_to_weigh("io cgroup")
        if policy.mode == OFF:
            raise NoIoControl(f"stays off: {policy.summary()}")
        detail: dict[str, Any] = {
            "cgroup_version": h.version,
            "io_policy": policy.as_dict(),
            "worker_cgroups": found,
            "best_effort": tuple(self.cfg.best_effort_cgroups),
            "unresolved": dict(self.cgroups.unresolved),
        }
        fresh = not self.writes.paths and self.name not in self.throttle.holds  # not a refresh
        try:
            if policy.weighted:
                writes = []
                for cg in dict.fromkeys(found.values()):  # workers sharing a cgroup raise it once
                    writes += h.weight_writes(cg, self.cfg.worker_io_weight)
                for cg in self.cfg.best_effort_cgroups:
                    writes += h.weight_writes(cg, self.cfg.best_effort_io_weight)
                for path, value in writes:
                    self.writes.set(path, value)
            if policy.capped():
                detail["capped_devices"] = self.throttle.hold(self.name, policy.capped())["devices"]
        except (CgroupError, KnobError):
            if fresh:
                self.release()  # none weighed rather than some
            raise
        return detail

    def stale(self) -> bool:
        return self.cgroups.stale()

    def release(self) -> list[str]:
        self.cgroups.forget()
        return self.throttle.drop(self.name) + self.writes.undo_all()


class IoThrottle:
    """The io_throttle lever, and the writer of every best-effort write cap: io_weight holds it
    for the disks it cannot weigh (`hold`). Each holder names its disks; the caps written are
    those of all holders together, and a disk's lines go once no holder wants it."""

    name = "io_throttle"
    dry_run_note = "would cap the best-effort cgroups' writes"

    def __init__(
        self,
        cfg: LeversConfig,
        writes: KnobWrites,
        procfs: str = "/proc",
        sysfs: str = "/sys",
        enables: Enables | None = None,
    ):
        """`enables`: the lever writer's (agent/levers/writers.py): where systemd brings io.max into being."""
        self.cfg, self.writes, self.procfs, self.sysfs, self.enables = cfg, writes, procfs, sysfs, enables
        self.holds: dict[str, tuple[str, ...]] = {}  # holder (a lever's name) -> the disks it has capped

    def devices(self) -> list[str]:
        return throttle_devices(self.cfg, self.procfs, self.sysfs)

    def engage(self) -> dict[str, Any]:
        return self.hold(self.name, self.devices())

    def hold(self, holder: str, devices: Sequence[str]) -> dict[str, Any]:
        """Cap the best-effort cgroups' writes on `devices` for `holder` (besides what others hold)."""
        cfg = self.cfg
        if not cfg.best_effort_cgroups:
            raise CgroupError("no best-effort cgroups to throttle (levers.best_effort_cgroups)")
        if not cfg.best_effort_write_bps and not cfg.best_effort_write_iops:
            raise CgroupError("levers.best_effort_write_bps and best_effort_write_iops are both 0: nothing to cap")
        h = io_hierarchy(cfg, self.enables)
        if not devices:
            raise CgroupError("no disk to throttle: no mounted filesystem on one (levers.io_throttle_devices)")
        holds = {**self.holds, holder: tuple(devices)}
        union = list(dict.fromkeys(d for held in holds.values() for d in held))
        before = set(self.writes.paths)
        try:
            for cg in cfg.best_effort_cgroups:
                bps, iops = cfg.best_effort_write_bps, cfg.best_effort_write_iops
                for path, value, device, absent in h.throttle_writes(cg, union, bps, iops):
                    self.writes.set(path, value, device, absent=absent)
        except (CgroupError, KnobError):
            for name in [n for n in reversed(self.writes.paths) if n not in before]:
                self.writes.undo(name)  # none capped rather than some (what others hold stays)
            raise
        self.holds = holds
        return {
            "cgroup_version": h.version,
            "devices": list(devices),
            "best_effort": tuple(cfg.best_effort_cgroups),
            "write_bps": cfg.best_effort_write_bps,
            "write_iops": cfg.best_effort_write_iops,
        }

    def drop(self, holder: str) -> list[str]:
        """`holder` no longer wants caps: undo the lines of the disks no other holder wants."""
        if self.holds.pop(holder, None) is None:
            return []
        kept = {d for held in self.holds.values() for d in held}
        entries = self.writes.journal.entries
        gone = [n for n in reversed(self.writes.paths) if n not in entries or entries[n].key not in kept]
        return [p for p in (self.writes.undo(name) for name in gone) if p]

    def stale(self) -> bool:
        return False  # no worker's cgroup to look for

    def release(self) -> list[str]:
        return self.drop(self.name)
