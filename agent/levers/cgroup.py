"""The CPU-share lever: favour the workers over co-located best-effort work while degraded.

It raises every worker's cgroup weight and lowers (optionally caps) the configured best-effort
cgroups' (a batch slice, say) on cgroup v1 or v2 (turbonode/cgroups.py). Where a worker runs
under a CPU quota it shares with other cgroups (a Kubernetes pod's limit over its containers, a
systemd slice's CPUQuota=), it also caps those neighbours at a share of that quota: a weight acts
per CPU, but a quota is one budget spent on every CPU at once, so a hog on another CPU spends
the worker's budget whatever their weights (measured: bench/capacity.py's fault cell). Measured on the
development VM (docs/benchmarks.md): a hog in another session gets the same CPU share as the
worker whatever its nice (sched_autogroup), and a lowered weight on the hog's cgroup alone
leaves the 2-thread tail; raising the worker's weight above its neighbours keeps its steps
at idle speed. Writes go through the KnobJournal: reversible, restored after a crash.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbonode.cgroups import V2_WEIGHT_MAX, V2_WEIGHT_MIN, CgroupError, CpuHierarchy, Hierarchy, slice_path
from turbonode.config import LeversConfig

from .journal import KnobJournal

RESOLVE_RETRY_S = 1.0  # while engaged, a worker whose cgroup was not found is looked for again this often


@dataclass
class CpuShareLever:
    """Favour the workers' cgroups over best-effort cgroups while engaged; undo restores them all."""

    hierarchy: CpuHierarchy
    journal: KnobJournal
    workers: tuple[str, ...]  # the workers' cgroups (none: leave them alone)
    best_effort: tuple[str, ...]  # cgroups of co-located batch work
    worker_weight: int = V2_WEIGHT_MAX
    best_effort_weight: int = V2_WEIGHT_MIN
    best_effort_cpus: float | None = None  # a hard cap as well, in CPUs; None: weight only
    neighbour_share: float = 0.0  # cap quota_neighbours at this share of the quota they share; 0: leave them
    spared: tuple[str, ...] = ()  # cgroups never capped as neighbours: the agent's own
    engaged: list[str] = field(default_factory=list)  # the journal's names of the knobs written, in order
    files: set[str] = field(default_factory=set)  # the knob files they stand for (a unit's property: its file)

    def writes(self) -> list[tuple[str, str]]:
        """Every (file, value) the lever writes when engaged; raises for a missing cgroup."""
        out = []
        for cg in self.workers:
            if cg != "/":  # the root cgroup has no weight
                out.append((self.hierarchy.weight_file(cg)[0], self.hierarchy.weight_value(self.worker_weight)))
        for cg in self.best_effort:
            out.append((self.hierarchy.weight_file(cg)[0], self.hierarchy.weight_value(self.best_effort_weight)))
            if self.best_effort_cpus is not None:
                out += self.hierarchy.quota_writes(cg, self.best_effort_cpus)
        for cg, cap in self.neighbour_caps().items():
            out += self.hierarchy.quota_writes(cg, cap)
        return out

    def neighbour_caps(self) -> dict[str, float]:
        """{cgroup: CPUs} for each quota neighbour of the workers this lever caps: not a
        best-effort cgroup with a cap of its own (best_effort_cpus), not capped tighter already."""
        if not self.neighbour_share:
            return {}
        out = {}
        for cg, quota in quota_neighbours(self.hierarchy, self.workers, self.spared).items():
            if cg in self.best_effort and self.best_effort_cpus is not None:
                continue
            cap = quota * self.neighbour_share
            try:
                own = self.hierarchy.quota_cpus(cg)
            except CgroupError:
                own = None
            ours = {f for f, _ in self.hierarchy.quota_writes(cg, cap)} & self.files
            if own is None or own > cap or ours:  # a tighter cap someone else set stays
                out[cg] = cap
        return out

    def engage(self) -> None:
        for path, value in self.writes():
            name = self.journal.set(path, value)  # a unit's property on a systemd host (writers.py)
            self.files.add(path)
            if name not in self.engaged:
                self.engaged.append(name)

    def release(self) -> list[str]:
        """Undo what engage wrote; the problems, one line each."""
        problems = [p for p in (self.journal.undo(path) for path in reversed(self.engaged)) if p]
        self.engaged.clear()
        self.files.clear()
        return problems


def quota_neighbours(hierarchy: CpuHierarchy, workers: Sequence[str], spared: Sequence[str] = ()) -> dict[str, float]:
    """{cgroup: CPUs of the quota it shares with a worker}: below each worker's nearest ancestor
    with a CPU quota of its own, every cgroup beside the path down to the worker (and holding no
    worker, nor a `spared` cgroup). They spend the budget the worker runs on."""
    on_path = {
        "/".join(w.rstrip("/").split("/")[:i]) or "/" for w in (*workers, *spared) for i in range(1, w.count("/") + 2)
    }
    out: dict[str, float] = {}
    for worker in workers:
        parts = worker.strip("/").split("/")
        for depth in range(len(parts) - 1, 0, -1):  # the worker's parent up to the top level
            ancestor = "/" + "/".join(parts[:depth])
            try:
                quota = hierarchy.quota_cpus(ancestor)
            except CgroupError:
                continue
            if quota is None:
                continue
            for level in range(depth, len(parts)):
                parent = "/" + "/".join(parts[:level])
                try:
                    names = sorted(os.listdir(hierarchy.dir(parent)))
                except OSError:  # removed meanwhile
                    continue
                for name in names:
                    cg = f"{parent}/{name}"
                    if cg not in on_path and os.path.isdir(hierarchy.dir(cg)):
                        out.setdefault(cg, quota)
            break  # the nearest quota: the budget the worker draws on
    return out


@dataclass(frozen=True)
class WorkerCgroup:
    """Where one worker's cgroup comes from: its setting ('auto': the cgroup of its pid, as its
    latest status named it, None while it has not answered; a path or slice; '': leave it)."""

    name: str
    setting: str
    pid: Callable[[], int | None]


def worker_cgroup(setting: str, hierarchy: Hierarchy, worker_pid: Callable[[], int | None], procfs: str) -> str | None:
    """The cgroup a worker's setting names: 'auto' is the worker process's own; '' is none.
    The root cgroup has no weight to raise nor memory to protect: None."""
    if not setting:
        return None
    if setting != "auto":
        cgroup = slice_path(setting)
    else:
        pid = worker_pid()
        if pid is None:
            raise CgroupError("its pid is not known yet (it has not answered its status)")
        cgroup = hierarchy.of_pid(pid, procfs)
    return None if cgroup == "/" else cgroup


class WorkerCgroups:
    """Every worker's cgroup in one hierarchy, found each time a lever engages (a worker may have
    restarted meanwhile). A worker whose cgroup cannot be found (not answering yet) is left out
    and named in `unresolved`; while the lever is engaged it is looked for again (`stale`), as
    the agent's refresh does (agent/levers/__init__.py). `setting` gives a worker's setting
    (default: its own, WorkerCgroup.setting)."""

    def __init__(
        self, workers: Sequence[WorkerCgroup], procfs: str, setting: Callable[[WorkerCgroup], str] | None = None
    ):
        self.workers, self.procfs = tuple(workers), procfs
        self.setting = setting or (lambda w: w.setting)
        self.unresolved: dict[str, str] = {}
        self._resolved_at = 0.0

    def find(self, hierarchy: Hierarchy) -> dict[str, str]:
        """{worker: cgroup} of those found and neither the root nor unset."""
        found: dict[str, str] = {}
        self.unresolved, self._resolved_at = {}, time.monotonic()
        for w in self.workers:
            try:
                cgroup = worker_cgroup(self.setting(w), hierarchy, w.pid, self.procfs)
            except CgroupError as exc:
                self.unresolved[w.name] = str(exc)
                continue
            if cgroup is not None:
                found[w.name] = cgroup
        return found

    def nothing_to_weigh(self, what: str) -> CgroupError:
        """The error of a weight lever that found no worker's `what` cgroup and has no best-effort
        cgroups either; it names why each worker's was not found."""
        why = "; ".join(f"worker {n}: {e}" for n, e in self.unresolved.items())
        return CgroupError(
            f"nothing to weigh: no worker's {what} (the root, unset or not found"
            + (f": {why}" if why else "")
            + ") and no levers.best_effort_cgroups are configured"
        )

    def stale(self) -> bool:
        """Some worker's cgroup was not found, and it is time to look for it again."""
        return bool(self.unresolved) and time.monotonic() - self._resolved_at >= RESOLVE_RETRY_S

    def forget(self) -> None:
        """Released: nothing to look for."""
        self.unresolved = {}


class CpuShare:
    """The `cpu_share` lever as the agent runs it: resolves the workers' cgroups when engaged
    (WorkerCgroups: one not found leaves the others' raised, and is looked for again while
    engaged), writes through the journal, undoes what it wrote."""

    name = "cpu_share"
    dry_run_note = "would raise the workers' CPU weight and lower the best-effort cgroups'"

    def __init__(self, cfg: LeversConfig, journal: KnobJournal, workers: Sequence[WorkerCgroup], procfs: str):
        self.cfg, self.journal, self.procfs = cfg, journal, procfs
        self.cgroups = WorkerCgroups(workers, procfs)
        self.lever: CpuShareLever | None = None

    def engage(self) -> dict[str, Any]:
        hierarchy = CpuHierarchy.find(self.cfg.cgroup_root)
        found = self.cgroups.find(hierarchy)
        if not found and not self.cfg.best_effort_cgroups:
            raise self.cgroups.nothing_to_weigh("cgroup")
        lever = CpuShareLever(
            hierarchy,
            self.journal,
            tuple(dict.fromkeys(found.values())),  # workers sharing a cgroup raise it once
            tuple(self.cfg.best_effort_cgroups),
            self.cfg.worker_cpu_weight,
            self.cfg.best_effort_cpu_weight,
            self.cfg.best_effort_cpus or None,
            self.cfg.quota_neighbour_share,
            self._own_cgroup(hierarchy),
        )
        if self.lever is not None:  # engaged again (refresh): release undoes the first writes too
            lever.engaged, lever.files = list(self.lever.engaged), set(self.lever.files)
        self.lever = lever
        lever.engage()
        return {
            "cgroup_version": hierarchy.version,
            "worker_cgroups": found,
            "best_effort": lever.best_effort,
            "quota_neighbours": lever.neighbour_caps(),
            "unresolved": dict(self.cgroups.unresolved),
        }

    def _own_cgroup(self, hierarchy: CpuHierarchy) -> tuple[str, ...]:
        """The agent's own cgroup, never capped as a worker's quota neighbour: a sidecar in the
        worker's pod, or the sandbox node's `other`, would otherwise cap the agent itself at a
        tenth of the quota (bench/capacity.py's fault cell: its status calls timed out)."""
        try:
            return (hierarchy.of_pid(os.getpid(), self.procfs),)
        except CgroupError:
            return ()

    def stale(self) -> bool:
        return self.cgroups.stale()

    def release(self) -> list[str]:
        problems = self.lever.release() if self.lever is not None else []
        self.lever = None
        self.cgroups.forget()
        return problems
