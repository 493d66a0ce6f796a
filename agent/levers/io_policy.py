"""Which io control the kernel offers the io levers, per disk: weights, write limits, or nothing.

An io weight (io_weight) acts on a disk only where a proportional policy schedules it: BFQ as the
disk's scheduler (v1 blkio.bfq.weight, v2 io.bfq.weight), CFQ on kernels before 5.0 (v1
blkio.weight), or on v2 the io cost model switched on for it (the root's io.cost.qos). Under
`none`, `mq-deadline` or `kyber` -- the defaults of NVMe hosts and of the development VM -- a weight
is accepted where the file exists and does nothing, and on v1 without BFQ there is no file to
write at all. Write limits (blk-throttle: v1 blkio.throttle.*, v2 io.max; what io_throttle writes)
act under any scheduler. So io_weight weighs the disks that have a proportional policy, caps the
best-effort cgroups' writes on the others (through the io_throttle lever's own writer,
agent/levers/io.py), and stays off, saying why, where neither can be had.

`probe` reads the facts (sysfs, the cgroup tree); `IoPolicy` is what they allow, pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from turbonode import block_devices
from turbonode.block_devices import DeviceError
from turbonode.memory_cgroups import IoHierarchy

WEIGHT, THROTTLE, BOTH, OFF = "weight", "throttle", "weight+throttle", "off"
IO_MODES = (WEIGHT, BOTH, THROTTLE, OFF)  # what io_weight can do on a host (turbonode_lever_mode)
# the schedulers whose v1 weight file a policy reads: BFQ since 5.0, CFQ before
V1_WEIGHT_FILES = {"bfq": "blkio.bfq.weight", "cfq": "blkio.weight"}


@dataclass(frozen=True)
class IoPolicy:
    """What the io levers can do on each disk."""

    weighted: Mapping[str, str] = field(default_factory=dict)  # disk -> what weighs it (bfq, cfq, io.cost)
    unweighted: Mapping[str, str] = field(default_factory=dict)  # disk -> why a weight does nothing there
    no_throttle: str | None = None  # why write limits cannot be had; None: they can

    @property
    def mode(self) -> str:
        if not self.unweighted:
            return WEIGHT if self.weighted else OFF
        if self.no_throttle is not None:
            return WEIGHT if self.weighted else OFF
        return BOTH if self.weighted else THROTTLE

    def capped(self) -> list[str]:
        """The disks io_weight caps the best-effort writes on instead of weighing."""
        return list(self.unweighted) if self.no_throttle is None else []

    def summary(self) -> str:
        """One line for status and doctor: what io_weight does here and why."""
        weighed = ", ".join(f"{d} ({how})" for d, how in self.weighted.items())
        unweighed = ", ".join(f"{d} ({why})" for d, why in self.unweighted.items())
        mode = self.mode
        if mode == WEIGHT:
            if not self.unweighted:
                return f"weights act on {weighed}"
            return f"weights act on {weighed}; none on {unweighed}, and no write limits: {self.no_throttle}"
        if mode == BOTH:
            return f"weights act on {weighed}; on {unweighed} no proportional io policy: best-effort writes capped"
        if mode == THROTTLE:
            return f"no proportional io policy on {unweighed}: best-effort writes capped instead (io.max/blk-throttle)"
        if not self.unweighted:
            return "no disk to weigh (no mounted filesystem on one: levers.io_throttle_devices)"
        return f"no proportional io policy on {unweighed}, and no write limits: {self.no_throttle}"

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "summary": self.summary(),
            "weighted": dict(self.weighted),
            "unweighted": dict(self.unweighted),
            "throttle": "available" if self.no_throttle is None else f"none: {self.no_throttle}",
        }


def disk_weighing(h: IoHierarchy, disk: str, sysfs: str = "/sys") -> tuple[str | None, str]:
    """(what weighs `disk`'s io by cgroup, or None; why not): its scheduler, or v2's io.cost."""
    if h.cost_enabled(disk):
        return "io.cost", ""
    try:
        sched = block_devices.scheduler(disk, sysfs)
    except DeviceError as exc:
        return None, str(exc)
    if h.version == 1:
        weight_file = V1_WEIGHT_FILES.get(sched)
        if weight_file is None:
            return None, f"scheduler {sched}"
        if not h.has_root_file(weight_file):
            return None, f"scheduler {sched} without cgroup support (no {weight_file})"
        return sched, ""
    if sched == "bfq":
        return sched, ""
    return None, f"scheduler {sched}, io.cost off"


def no_throttle(h: IoHierarchy, best_effort: Sequence[str], bps: int, iops: int) -> str | None:
    """Why the best-effort cgroups' writes cannot be capped; None when they can."""
    if not best_effort:
        return "no levers.best_effort_cgroups to cap"
    if not bps and not iops:
        return "levers.best_effort_write_bps and best_effort_write_iops are both 0"
    return next((why for why in (h.throttle_missing(cg) for cg in best_effort) if why), None)


def probe(
    h: IoHierarchy, disks: Sequence[str], best_effort: Sequence[str], bps: int, iops: int, sysfs: str = "/sys"
) -> IoPolicy:
    """What the io levers can do on `disks` ("MAJ:MIN") for these best-effort cgroups and limits."""
    weighted, unweighted = {}, {}
    for disk in disks:
        how, why = disk_weighing(h, disk, sysfs)
        if how is None:
            unweighted[disk] = why
        else:
            weighted[disk] = how
    return IoPolicy(weighted, unweighted, no_throttle(h, best_effort, bps, iops) if unweighted else None)
