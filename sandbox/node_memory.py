"""The sandbox node's RAM and disk share: a memory cgroup whose limit stands for the node's memory,
and blkio cgroups, beside the cpu cgroups of sandbox/node.py.

The node's processes (the worker, the agent, the batch work) run in children of one parent
memory cgroup, `/<node>-node`, limited to `memory_mb`: reclaim and OOM then happen inside it, as
they would on a node with that much RAM, never to the machine the sandbox runs on. The agent is
in it too (the kernel must pick neither it nor the worker). The load generator is not: it
stands for clients on other machines. In the io hierarchy (blkio on v1), the worker and the batch
work get cgroups of the same names as their cpu ones, as systemd mirrors a unit's cgroup in
every v1 hierarchy, so that the agent's io lever finds them under `levers.best_effort_cgroups`.

A page of a file is charged to the memory cgroup of the process that read it first, and stays
charged there while it is cached: the worker's libraries (libtorch and the rest of its Python
environment), read by earlier runs and tests, would be charged outside the node, where its
reclaim never reaches them. On a real node every page is the node's. So before the worker
starts, `evict_libraries` drops the environment's shared libraries from the page cache
(posix_fadvise DONTNEED: only pages no process maps go, a clean page is only re-read), and the
worker's own reads charge them to its cgroup.

A hierarchy that is missing (no memory or io controller) or read-only (a container) is reported
and left out; everything made here is removed by `remove`, also after a failed start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from turbonode.cgroups import CgroupError, Hierarchy
from turbonode.memory_cgroups import IoHierarchy, MemoryHierarchy

MIB = 1 << 20
ROLES = ("worker", "batch", "agent")  # children of the node's memory cgroup
H = TypeVar("H", bound=Hierarchy)


class NodeMemory:
    def __init__(self, node: str, memory_mb: int, io_cgroups: dict[str, str], log: Callable[[str], object] = print):
        """`node`: the node's name (its netns); `io_cgroups`: role -> the cgroup path the role has in
        the cpu hierarchy, made in the io hierarchy too."""
        self.memory_mb, self.log = memory_mb, log
        self.parent = f"/{node}-node"
        self.memory_roles = {role: f"{self.parent}/{role}" for role in ROLES}
        self.io_roles = dict(io_cgroups)
        self.memory = self._find(MemoryHierarchy) if memory_mb else None
        self.io = self._find(IoHierarchy)
        self._made: list[tuple[Hierarchy, str]] = []

    def _find(self, kind: type[H]) -> H | None:
        try:
            return kind.find()
        except CgroupError as exc:
            self.log(f"no cgroup {kind.controller} controller ({exc}): the node runs without it")
            return None

    def make(self) -> None:
        plans: list[tuple[Hierarchy | None, list[str]]] = [
            (self.memory, [self.parent, *self.memory_roles.values()]),
            (self.io, _with_parents(self.io_roles.values())),
        ]
        for h, cgroups in plans:
            if h is None:
                continue
            try:
                for cg in cgroups:
                    h.create(cg)
                    self._made.append((h, cg))
                    if self.memory is not None and cg == self.parent:  # before any process is in it
                        Path(self.memory.limit_file(cg)).write_text(str(self.memory_mb * MIB))
            except (CgroupError, OSError) as exc:  # read-only in a container (systemd-nspawn), say
                self.log(f"cannot make the node's {h.controller} cgroups ({exc}): running without them")
                self._remove(h)
                if h is self.memory:
                    self.memory = None
                else:
                    self.io = None

    def remove(self) -> None:
        for h in {h for h, _ in self._made}:
            self._remove(h)

    def _remove(self, h: Hierarchy) -> None:
        for made in reversed([m for m in self._made if m[0] is h]):
            try:
                h.remove(made[1])
            except CgroupError as exc:
                self.log(f"warning: {exc}")
            self._made.remove(made)

    def set_swappiness(self, value: int) -> None:
        """memory.swappiness of the node's cgroups (v1 has it per cgroup; v2 only the global sysctl)."""
        if self.memory is None or self.memory.version != 1:
            raise CgroupError("per-cgroup memory.swappiness needs the node's memory cgroup on cgroup v1")
        for cg in (self.parent, *self.memory_roles.values()):
            Path(self.memory.file(cg, "memory.swappiness")).write_text(str(value))

    def procs_files(self, role: str) -> list[str]:
        """The cgroup.procs files a process of `role` writes its pid to, in these hierarchies."""
        out = []
        if self.memory is not None and role in self.memory_roles:
            out.append(self.memory.procs_file(self.memory_roles[role]))
        if self.io is not None and role in self.io_roles:
            out.append(self.io.procs_file(self.io_roles[role]))
        return out

    def levers_toml(self) -> str:
        """The agent's [levers] keys for what is made here."""
        if self.memory is None:
            return ""
        return f'memory_best_effort_cgroups = ["{self.memory_roles["batch"]}"]\n'

    def written_bytes(self, role: str) -> int | None:
        """Bytes the role's io cgroup has written (None: no io cgroups here)."""
        if self.io is None or role not in self.io_roles:
            return None
        return self.io.written_bytes(self.io_roles[role])

    def oom_kills(self) -> dict[str, int]:
        """OOM kills so far in each role's memory cgroup."""
        if self.memory is None:
            return {}
        return {role: self.memory.events(cg).get("oom_kill", 0) for role, cg in self.memory_roles.items()}


def _with_parents(cgroups: Iterable[str]) -> list[str]:
    """`cgroups` each after its parents (a fleet's node nests its roles under a cgroup of its own)."""
    out: list[str] = []
    for cg in cgroups:
        parts = cg.strip("/").split("/")
        out += [p for i in range(1, len(parts) + 1) if (p := "/" + "/".join(parts[:i])) not in out]
    return out


def evict_libraries(prefix: str = sys.prefix) -> int:
    """Drop the unmapped cached pages of the shared libraries under `prefix` (a Python environment);
    how many files were advised."""
    n = 0
    for directory, _, files in os.walk(prefix):
        for name in files:
            if ".so" not in name:
                continue
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n
