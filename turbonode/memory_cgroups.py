"""The memory and io controllers' hierarchies (v1 or v2) and the knob files the levers, the memory
watcher and the sandbox node use (turbonode/cgroups.py finds them).

Memory, v2 | v1:
  usage                 memory.current | memory.usage_in_bytes
  limit (the node's)    memory.max | memory.limit_in_bytes
  protection            memory.min | none: v1 has no protection of a cgroup's pages from reclaim
  squeeze               memory.high (throttled and reclaimed above it, never killed) |
                        memory.limit_in_bytes with OOM killing disabled in the cgroup
                        (memory.oom_control oom_kill_disable 1): its tasks wait at the limit
                        instead of being killed, which is what memory.high does for a job whose
                        memory cannot be reclaimed (anonymous memory, no swap)
  events                memory.events (low, high, max, oom, oom_kill) |
                        memory.failcnt (as `max`) and memory.oom_control's oom_kill
  major faults          memory.stat pgmajfault | memory.stat total_pgmajfault (hierarchical both)
  file pages            memory.stat active_file + inactive_file | the same with total_
  pressure              memory.pressure | none (on a hybrid host PSI per cgroup exists only in the
                        v2 mount: turbonode/memory_cgroups.psi_file)

Io, v2 | v1 (blkio): weight io.weight (and io.bfq.weight where BFQ schedules the device) |
blkio.bfq.weight (BFQ, the kernel's only proportional v1 policy since 5.0; blkio.weight of CFQ
before). Weights are given in v2 units (1..10000, default 100) and converted for v1 as systemd
converts IOWeight=; they act only where the device's scheduler is BFQ (or, on v2, io.cost is on).
Write limits, per device (a whole disk's "MAJ:MIN", turbonode/block_devices.py): io.max's wbps and
wiops | blkio.throttle.write_bps_device and write_iops_device (blk-throttle: any scheduler). On v1
only the bios a cgroup's tasks submit themselves are charged to it (direct io, and the writeback
their fsync or sync_file_range starts); the flusher's background writeback of their dirty pages is
the root's. On v2 with the memory controller beside io, that writeback is the cgroup's too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .cgroups import UNIFIED, CgroupError, Hierarchy

PAGE = os.sysconf("SC_PAGE_SIZE")
IO_WEIGHT_MIN, IO_WEIGHT_MAX = 1, 10000  # io.weight, v2 units
BFQ_WEIGHT_MIN, BFQ_WEIGHT_MAX = 1, 1000  # blkio.bfq.weight / io.bfq.weight
CFQ_WEIGHT_MIN, CFQ_WEIGHT_MAX = 10, 1000  # blkio.weight (CFQ, kernels before 5.0)
V1_NO_LIMIT = "0"  # a device without a line in blkio.throttle.*_device; writing 0 removes its line
V2_NO_LIMIT = "rbps=max wbps=max riops=max wiops=max"  # ... in io.max; writing it removes the line
OOM_CONTROL = "memory.oom_control"
OOM_KILL_DISABLE = "oom_kill_disable"  # the key of memory.oom_control that a write sets
NO_PROTECTION_V1 = "cgroup v1 has no memory.min: its pages cannot be protected by the cgroup"


def keyed(text: str) -> dict[str, int]:
    """'key value' lines (memory.events, memory.stat, memory.oom_control) -> {key: value}."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class MemoryHierarchy(Hierarchy):
    controller = "memory"
    v1_name = "memory"
    v1_mounts = ("memory",)
    v1_probe = "memory.limit_in_bytes"

    def usage_file(self, cgroup: str) -> str:
        return self.file(cgroup, "memory.current" if self.version == 2 else "memory.usage_in_bytes")

    def usage(self, cgroup: str) -> int:
        try:
            with open(self.usage_file(cgroup)) as f:
                return int(f.read())
        except OSError as exc:
            raise CgroupError(f"cannot read the memory usage of {cgroup}: {exc.strerror or exc}") from None

    def limit_file(self, cgroup: str) -> str:
        return self.file(cgroup, "memory.max" if self.version == 2 else "memory.limit_in_bytes")

    def protect_writes(self, usage: Mapping[str, int]) -> list[tuple[str, str]]:
        """Keep what each cgroup of `usage` uses ({cgroup: bytes}) from reclaim: its memory.min,
        and each ancestor's at least what the cgroups under it use together (a child's protection
        is bounded by its parent's, shared out among its children). v1 has nothing of the kind."""
        if self.version == 1:
            raise CgroupError(NO_PROTECTION_V1)
        chains = {cg: tuple(p for p in cg.strip("/").split("/") if p) for cg in usage}
        # those under no other of them: their usage counts in their ancestors' once
        top = [cg for cg, p in chains.items() if not any(o != p and p[: len(o)] == o for o in chains.values())]
        need = {parts: usage[cg] for cg, parts in chains.items()}
        for cg in top:
            parts = chains[cg]
            for depth in range(1, len(parts)):
                need[parts[:depth]] = need.get(parts[:depth], 0) + usage[cg]
        out = []
        for parts in sorted(need, key=len, reverse=True):  # deepest first
            path = "/" + "/".join(parts)
            current = self.read(path, "memory.min").strip()
            if current == "max" or int(current) >= need[parts]:
                continue
            out.append((self.file(path, "memory.min"), str(need[parts])))
        return out

    def squeeze_writes(self, cgroup: str, nbytes: int) -> list[tuple[str, str, str | None]]:
        """(file, value, key) writes that hold `cgroup` at `nbytes` without killing its tasks; key
        names the line of a 'key value' file the write sets (None: the whole file)."""
        nbytes = -(-nbytes // PAGE) * PAGE
        if self.version == 2:
            return [(self.file(cgroup, "memory.high"), str(nbytes), None)]
        return [
            (self.file(cgroup, OOM_CONTROL), "1", OOM_KILL_DISABLE),  # first: no kill at the new limit
            (self.file(cgroup, "memory.limit_in_bytes"), str(nbytes), None),
        ]

    def events(self, cgroup: str) -> dict[str, int]:
        """Counters since the cgroup was made: max (usage hit the limit), oom, oom_kill; on v2 also
        low and high."""
        if self.version == 2:
            return keyed(self.read(cgroup, "memory.events"))
        oom = keyed(self.read(cgroup, OOM_CONTROL))
        return {"max": int(self.read(cgroup, "memory.failcnt")), "oom_kill": oom.get("oom_kill", 0)}

    def waiting_at_limit(self, cgroup: str) -> bool:
        """v1: tasks of `cgroup` wait at its limit (OOM killing disabled in it: the squeeze);
        v2 has no such state (memory.high throttles: its `high` events count up instead)."""
        return self.version == 1 and keyed(self.read(cgroup, OOM_CONTROL)).get("under_oom", 0) == 1

    def file_pages(self, cgroup: str) -> int:
        """Bytes of file pages on the cgroup's LRU lists, its own and its children's: what reclaim
        can take without swap."""
        stat = keyed(self.read(cgroup, "memory.stat"))
        prefix = "" if self.version == 2 else "total_"
        return stat[f"{prefix}active_file"] + stat[f"{prefix}inactive_file"]

    def major_faults(self, cgroup: str) -> int:
        stat = keyed(self.read(cgroup, "memory.stat"))
        return stat["pgmajfault" if self.version == 2 else "total_pgmajfault"]


def psi_file(cgroup_root: str, pid: int | str, resource: str = "memory", procfs: str = "/proc") -> str | None:
    """The PSI file of the v2 cgroup process `pid` is in (its `0::` line), where per-cgroup PSI
    exists: on a v2 host under the root, on a hybrid host under its v2 mount. None when the
    process is in the v2 root (its pressure is the node's: /proc/pressure) or there is none."""
    try:
        with open(os.path.join(procfs, str(pid), "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise CgroupError(f"cannot read the cgroup of pid {pid}: {exc.strerror or exc}") from None
    path = next((line[3:] for line in lines if line.startswith("0::")), "/")
    if path == "/":
        return None
    for mount in (cgroup_root, os.path.join(cgroup_root, UNIFIED)):
        candidate = os.path.join(mount, path.lstrip("/"), f"{resource}.pressure")
        if os.path.exists(candidate):
            return candidate
    return None


@dataclass(frozen=True)
class IoHierarchy(Hierarchy):
    controller = "io"
    v1_name = "blkio"
    v1_mounts = ("blkio",)
    v1_probe = "blkio.reset_stats"
    # v2: whether the cgroup tree's owner enables the io controller for a knob's cgroup when a
    # limit is set through it (systemd for a unit's own cgroup: agent/levers/writers.py). Such a
    # cgroup has no io.max until then, which is no reason to refuse a write limit.
    owner_enables: Callable[[str], bool] | None = field(default=None, compare=False)

    def weight_writes(self, cgroup: str, weight: int) -> list[tuple[str, str]]:
        """(file, value) pairs that give `cgroup` an io weight of `weight` (v2 units)."""
        if not IO_WEIGHT_MIN <= weight <= IO_WEIGHT_MAX:
            raise ValueError(f"an io weight must be {IO_WEIGHT_MIN}..{IO_WEIGHT_MAX}, got {weight}")
        bfq = str(max(BFQ_WEIGHT_MIN, min(BFQ_WEIGHT_MAX, weight)))
        if self.version == 2:
            out = [(self.file(cgroup, "io.weight"), f"default {weight}")]
            if os.path.exists(os.path.join(self.dir(cgroup), "io.bfq.weight")):
                out.append((self.file(cgroup, "io.bfq.weight"), f"default {bfq}"))
            return out
        if os.path.exists(os.path.join(self.dir(cgroup), "blkio.bfq.weight")):
            return [(self.file(cgroup, "blkio.bfq.weight"), bfq)]
        if os.path.exists(os.path.join(self.dir(cgroup), "blkio.weight")):
            cfq = max(CFQ_WEIGHT_MIN, min(CFQ_WEIGHT_MAX, weight * 500 // 100))  # systemd's conversion
            return [(self.file(cgroup, "blkio.weight"), str(cfq))]
        self.file(cgroup, "blkio.bfq.weight")  # a missing cgroup is named as such
        raise CgroupError(f"cgroup {cgroup} has no blkio.bfq.weight or blkio.weight: no proportional io policy")

    def throttle_writes(
        self, cgroup: str, devices: Sequence[str], bps: int, iops: int
    ) -> list[tuple[str, str, str, str]]:
        """(file, value, device, absent) per-device lines that cap `cgroup`'s writes to each of
        `devices` ("MAJ:MIN") at `bps` bytes and `iops` requests a second (0: that one uncapped);
        `absent` is what the file reads for a device it has no line for (agent/levers/journal.py)."""
        if self.version == 2:
            value = f"wbps={bps or 'max'} wiops={iops or 'max'}"
            return [(self._throttle_file(cgroup, "io.max"), value, dev, V2_NO_LIMIT) for dev in devices]
        out = []
        for name, limit in (("blkio.throttle.write_bps_device", bps), ("blkio.throttle.write_iops_device", iops)):
            if limit:
                path = self._throttle_file(cgroup, name)
                out += [(path, str(limit), dev, V1_NO_LIMIT) for dev in devices]
        return out

    def cost_enabled(self, disk: str) -> bool:
        """v2: whether io.cost (the io cost model, weights under any scheduler) is on for `disk`,
        as the root's io.cost.qos says ("MAJ:MIN enable=1 ..."); absent (no CONFIG_BLK_CGROUP_IOCOST)
        or v1: False."""
        if self.version != 2:
            return False
        try:
            with open(os.path.join(self.mount, "io.cost.qos")) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        return any(line.split()[:2] == [disk, "enable=1"] for line in lines)

    def has_root_file(self, name: str) -> bool:
        """Whether the hierarchy's root cgroup has knob `name` (v1: what the kernel was built with)."""
        return os.path.exists(os.path.join(self.mount, name))

    def throttle_missing(self, cgroup: str) -> str | None:
        """Why `cgroup` cannot have its writes capped (no such cgroup, no io.max or blk-throttle);
        None when it can."""
        try:
            self._throttle_file(cgroup, "io.max" if self.version == 2 else "blkio.throttle.write_bps_device")
        except CgroupError as exc:
            return str(exc)
        return None

    def written_bytes(self, cgroup: str) -> int:
        """Bytes written to any device by `cgroup` and its children since it was made, as charged to
        it (v2 io.stat wbytes; v1 blkio.throttle.io_service_bytes_recursive, its Write lines)."""
        if self.version == 2:
            return sum(
                int(field[len("wbytes=") :])
                for line in self.read(cgroup, "io.stat").splitlines()
                for field in line.split()[1:]
                if field.startswith("wbytes=")
            )
        lines = self.read(cgroup, "blkio.throttle.io_service_bytes_recursive").splitlines()
        return sum(int(f[2]) for f in (line.split() for line in lines) if len(f) == 3 and f[1] == "Write")

    def _throttle_file(self, cgroup: str, name: str) -> str:
        path = self.file(cgroup, name)
        if not os.path.exists(path) and not (self.version == 2 and self.owner_enables and self.owner_enables(path)):
            why = "the io controller is not enabled for it" if self.version == 2 else "no CONFIG_BLK_DEV_THROTTLING"
            raise CgroupError(f"cgroup {cgroup} has no {name}: no io write limits ({why})")
        return path
