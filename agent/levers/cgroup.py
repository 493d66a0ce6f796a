"""The CPU-share lever: favour the worker over co-located best-effort work while degraded.

It raises the worker's cgroup weight and lowers (optionally caps) the configured best-effort
cgroups' (a batch slice, say) on cgroup v1 or v2 (turbonode/cgroups.py). Measured on the
development VM (docs/benchmarks.md): a hog in another session gets the same CPU share as the
worker whatever its nice (sched_autogroup), and a lowered weight on the hog's cgroup alone
leaves the 2-thread tail; raising the worker's weight above its neighbours keeps its steps
at idle speed. Writes go through the KnobJournal: reversible, restored after a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turbonode.cgroups import V2_WEIGHT_MAX, V2_WEIGHT_MIN, CgroupError, CpuHierarchy, Hierarchy, slice_path
from turbonode.config import LeversConfig

from .journal import KnobJournal


@dataclass
class CpuShareLever:
    """Favour the worker's cgroup over best-effort cgroups while engaged; undo restores both."""

    hierarchy: CpuHierarchy
    journal: KnobJournal
    worker: str | None  # the worker's cgroup (None: leave it alone)
    best_effort: tuple[str, ...]  # cgroups of co-located batch work
    worker_weight: int = V2_WEIGHT_MAX
    best_effort_weight: int = V2_WEIGHT_MIN
    best_effort_cpus: float | None = None  # a hard cap as well, in CPUs; None: weight only
    engaged: list[str] = field(default_factory=list)  # files written, in order

    def writes(self) -> list[tuple[str, str]]:
        """Every (file, value) the lever writes when engaged; raises for a missing cgroup."""
        out = []
        if self.worker is not None and self.worker != "/":  # the root cgroup has no weight
            out.append((self.hierarchy.weight_file(self.worker)[0], self.hierarchy.weight_value(self.worker_weight)))
        for cg in self.best_effort:
            out.append((self.hierarchy.weight_file(cg)[0], self.hierarchy.weight_value(self.best_effort_weight)))
            if self.best_effort_cpus is not None:
                out += self.hierarchy.quota_writes(cg, self.best_effort_cpus)
        return out

    def engage(self) -> None:
        for path, value in self.writes():
            self.journal.set(path, value)
            if path not in self.engaged:
                self.engaged.append(path)

    def release(self) -> list[str]:
        """Undo what engage wrote; the problems, one line each."""
        problems = [p for p in (self.journal.undo(path) for path in reversed(self.engaged)) if p]
        self.engaged.clear()
        return problems


def worker_cgroup(setting: str, hierarchy: Hierarchy, worker_pid: Callable[[], int], procfs: str) -> str | None:
    """The cgroup `levers.worker_cgroup` names: 'auto' is the worker process's own in `hierarchy`;
    '' is none. The root cgroup has no weight to raise nor memory to protect: None."""
    if not setting:
        return None
    cgroup = hierarchy.of_pid(worker_pid(), procfs) if setting == "auto" else slice_path(setting)
    return None if cgroup == "/" else cgroup


class CpuShare:
    """The `cpu_share` lever as the agent runs it: resolves the cgroups when engaged (the worker
    may have restarted meanwhile), writes through the journal, undoes what it wrote."""

    name = "cpu_share"
    dry_run_note = "would raise the worker's CPU weight and lower the best-effort cgroups'"

    def __init__(self, cfg: LeversConfig, journal: KnobJournal, worker_pid: Callable[[], int], procfs: str):
        self.cfg, self.journal, self.worker_pid, self.procfs = cfg, journal, worker_pid, procfs
        self.lever: CpuShareLever | None = None

    def engage(self) -> dict[str, Any]:
        hierarchy = CpuHierarchy.find(self.cfg.cgroup_root)
        worker = worker_cgroup(self.cfg.worker_cgroup, hierarchy, self.worker_pid, self.procfs)
        if worker is None and not self.cfg.best_effort_cgroups:
            raise CgroupError(
                "nothing to weigh: the worker's cgroup is the root or unset (levers.worker_cgroup) "
                "and no levers.best_effort_cgroups are configured"
            )
        self.lever = CpuShareLever(
            hierarchy,
            self.journal,
            worker,
            tuple(self.cfg.best_effort_cgroups),
            self.cfg.worker_cpu_weight,
            self.cfg.best_effort_cpu_weight,
            self.cfg.best_effort_cpus or None,
        )
        self.lever.engage()
        return {"cgroup_version": hierarchy.version, "worker_cgroup": worker, "best_effort": self.lever.best_effort}

    def release(self) -> list[str]:
        problems = self.lever.release() if self.lever is not None else []
        self.lever = None
        return problems
