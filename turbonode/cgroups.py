"""Cgroup hierarchies, v1 or v2, and the knob files of the CPU controller.

A controller lives in one mounted hierarchy at a time: on a v2-only host the root, whose
cgroup.controllers lists it; on a v1 or hybrid host its own v1 mount under the root (cpu at
<root>/cpu or cpu,cpuacct, memory at <root>/memory, io as blkio at <root>/blkio), unless it was
moved to a hybrid host's v2 mount at <root>/unified (sandbox/cgroup_v2.py does, for tests).
`Hierarchy.find` locates a controller's; the CPU knobs are here (shared by the agent's CPU-share
lever, agent/levers/cgroup.py, and the worker, which sizes its thread pool to the CPU quota it
runs under), the memory and io ones in turbonode/memory_cgroups.py.

CPU weights are given in cgroup v2 units (cpu.weight, 1..10000, default 100) and converted for
v1's cpu.shares the way systemd converts CPUWeight= (x 1024 / 100). Every path goes through a
root argument, so tests run on a fake tree as well as the real one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from .errors import TurbonodeError

V2_WEIGHT_MIN, V2_WEIGHT_MAX, V2_WEIGHT_DEFAULT = 1, 10000, 100
V1_SHARES_MIN, V1_SHARES_MAX = 2, 262144
PERIOD_US = 100_000
CGROUP_ROOT = "/sys/fs/cgroup"
UNIFIED = "unified"  # a hybrid host's v2 mount, under the root
H = TypeVar("H", bound="Hierarchy")


class CgroupError(TurbonodeError):
    """No usable controller, a cgroup that does not exist, or one that cannot be made or removed."""


def shares_from_weight(weight: int) -> int:
    """cgroup v2 cpu.weight -> v1 cpu.shares, as systemd converts CPUWeight=."""
    return max(V1_SHARES_MIN, min(V1_SHARES_MAX, weight * 1024 // V2_WEIGHT_DEFAULT))


def parse_cpu_list(text: str, most: int = 4096) -> frozenset[int]:
    """The kernel's CPU list format (cpuset.cpus, `taskset -c`): '0-3,8' -> {0, 1, 2, 3, 8}. Raises
    ValueError naming what is wrong; CPUs are numbered below `most`."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"expected a CPU list such as '0-3,8', got {text!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first > last or last >= most:
            raise ValueError(f"CPUs are 0..{most - 1} in ascending ranges, got {part.strip()!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def slice_path(name: str) -> str:
    """A cgroup given as a path ('/batch', 'system.slice/x.service') or a systemd slice name
    ('batch.slice', 'user-1000.slice' -> '/user.slice/user-1000.slice'), relative to the root."""
    if "/" in name or not name.endswith(".slice"):
        return "/" + name.strip("/")
    parts = name[: -len(".slice")].split("-")
    return "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


@dataclass(frozen=True)
class Hierarchy:
    """The mounted hierarchy that has a controller (a subclass names which)."""

    mount: str  # directory of the hierarchy's root cgroup
    version: int  # 1 or 2

    controller: ClassVar[str]  # its name in a v2 cgroup.controllers
    v1_name: ClassVar[str]  # its name in v1 (/proc/PID/cgroup, the mount's options)
    v1_mounts: ClassVar[tuple[str, ...]]  # where a v1 mount of it may be, under the root
    v1_probe: ClassVar[str]  # a file the root of a v1 mount of it has

    @classmethod
    def find(cls: type[H], root: str = CGROUP_ROOT) -> H:
        if cls.controller in _words(os.path.join(root, "cgroup.controllers")):
            return cls(root, 2)
        for name in cls.v1_mounts:
            mount = os.path.join(root, name)
            if os.path.exists(os.path.join(mount, cls.v1_probe)):
                return cls(mount, 1)
        unified = os.path.join(root, UNIFIED)
        # a hybrid host whose controller was moved to the v2 mount (no v1 mount of it left)
        if cls.controller in _words(os.path.join(unified, "cgroup.controllers")):
            return cls(unified, 2)
        hint = f" (the v2 mount there has no {cls.controller} controller)" if os.path.isdir(unified) else ""
        raise CgroupError(f"no cgroup {cls.controller} controller under {root}{hint}")

    def dir(self, cgroup: str) -> str:
        return os.path.join(self.mount, slice_path(cgroup).lstrip("/"))

    def of_pid(self, pid: int | str, procfs: str = "/proc") -> str:
        """The cgroup (path relative to the root) process `pid` is in, from <procfs>/<pid>/cgroup."""
        try:
            with open(os.path.join(procfs, str(pid), "cgroup")) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise CgroupError(f"cannot read the cgroup of pid {pid}: {exc.strerror or exc}") from None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if (self.version == 2 and controllers == "") or (
                self.version == 1 and self.v1_name in controllers.split(",")
            ):
                return path
        raise CgroupError(f"pid {pid} is in no cgroup of the {self.controller} hierarchy ({self.mount})")

    def file(self, cgroup: str, name: str) -> str:
        """The path of knob `name` of an existing `cgroup`."""
        d = self.dir(cgroup)
        if not os.path.isdir(d):
            raise CgroupError(f"cgroup {cgroup} does not exist ({d})")
        return os.path.join(d, name)

    def read(self, cgroup: str, name: str) -> str:
        try:
            with open(self.file(cgroup, name)) as f:
                return f.read()
        except OSError as exc:
            raise CgroupError(f"cannot read {name} of {cgroup}: {exc.strerror or exc}") from None

    # ---- for tests and benchmarks: cgroups of their own ------------------------------

    def create(self, cgroup: str) -> str:
        d = self.dir(cgroup)
        try:
            os.mkdir(d)
        except OSError as exc:
            raise CgroupError(f"cannot create cgroup {d}: {exc.strerror or exc}") from None
        return d

    def remove(self, cgroup: str) -> None:
        """rmdir the cgroup, moving any process still in it to the root first."""
        d = self.dir(cgroup)
        if not os.path.isdir(d):
            return
        for pid in _words(os.path.join(d, "cgroup.procs")):
            try:
                with open(os.path.join(self.mount, "cgroup.procs"), "w") as f:
                    f.write(pid)
            except OSError:
                pass  # exited meanwhile
        try:
            os.rmdir(d)
        except OSError as exc:
            raise CgroupError(f"cannot remove cgroup {d}: {exc.strerror or exc}") from None

    def procs_file(self, cgroup: str) -> str:
        return os.path.join(self.dir(cgroup), "cgroup.procs")

    def procs(self, cgroup: str) -> list[int]:
        """The processes in `cgroup` (not its children), as cgroup.procs lists them."""
        return [int(p) for p in self.read(cgroup, "cgroup.procs").split()]


@dataclass(frozen=True)
class CpuHierarchy(Hierarchy):
    """The mounted hierarchy that has the cpu controller."""

    controller = "cpu"
    v1_name = "cpu"
    v1_mounts = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
    v1_probe = "cpu.shares"

    # ---- the knobs ------------------------------------------------------------------

    def weight_file(self, cgroup: str) -> tuple[str, str]:
        name = "cpu.weight" if self.version == 2 else "cpu.shares"
        return self.file(cgroup, name), name

    def weight_value(self, weight: int) -> str:
        if not V2_WEIGHT_MIN <= weight <= V2_WEIGHT_MAX:
            raise ValueError(f"a CPU weight must be {V2_WEIGHT_MIN}..{V2_WEIGHT_MAX}, got {weight}")
        return str(weight if self.version == 2 else shares_from_weight(weight))

    def quota_writes(self, cgroup: str, cpus: float | None, period_us: int = PERIOD_US) -> list[tuple[str, str]]:
        """(file, value) pairs that cap `cgroup` at `cpus` CPUs per period of `period_us` (None: no cap)."""
        if cpus is not None and cpus <= 0:
            raise ValueError(f"a CPU quota must be positive, got {cpus}")
        quota = None if cpus is None else max(1000, int(cpus * period_us))
        if self.version == 2:
            return [(self.file(cgroup, "cpu.max"), f"{quota or 'max'} {period_us}")]
        return [
            (self.file(cgroup, "cpu.cfs_period_us"), str(period_us)),
            (self.file(cgroup, "cpu.cfs_quota_us"), str(quota or -1)),
        ]

    def quota_cpus(self, cgroup: str) -> float | None:
        """The CPUs per period `cgroup` may use (its own cap, not its parents'); None: no cap."""
        try:
            if self.version == 2:
                quota, period = self.read(cgroup, "cpu.max").split()
            else:
                quota = self.read(cgroup, "cpu.cfs_quota_us").strip()
                period = self.read(cgroup, "cpu.cfs_period_us").strip()
        except (CgroupError, ValueError) as exc:
            raise CgroupError(f"cannot read the CPU quota of {cgroup}: {exc}") from None
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)

    def quota_cpus_within(self, cgroup: str) -> float | None:
        """The CPUs per period `cgroup` may use under its own cap and its parents' (the smallest
        of them: a node's or a slice's quota holds for all below it); None: no cap on the path.
        A level that cannot be read is skipped (e.g. the root, which has no quota file)."""
        parts = slice_path(cgroup).strip("/").split("/")
        caps = []
        for depth in range(len(parts), 0, -1):
            try:
                quota = self.quota_cpus("/" + "/".join(parts[:depth]))
            except CgroupError:
                continue
            if quota is not None:
                caps.append(quota)
        return min(caps, default=None)


def _words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []
