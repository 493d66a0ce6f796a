"""The memory levers: the worker never the OOM killer's choice, best-effort jobs held where they
are while the node reclaims, the worker's cgroup protected from reclaim where the kernel can.

  oom_guard       standing while the agent runs (levers.oom_guard): oom_score_adj of the
                  worker's processes and of the agent itself lowered to levers.worker_oom_score_adj
                  (-900), of every process in the best-effort cgroups raised to
                  levers.best_effort_oom_score_adj (1000), new processes included (checked every
                  OOM_GUARD_PERIOD_S). An OOM in a node, a memory cgroup or the whole machine then
                  kills the batch job, not the worker with its model. Standing, not a rule's lever,
                  because an OOM can follow the first sign of pressure within a second. Lowering
                  needs CAP_SYS_RESOURCE (the agent's unit grants it; the worker's unit sets its
                  own -900): without it only the best-effort side is raised, which alone makes
                  the OOM killer pick a best-effort process first, and the status says so.
  memory_squeeze  while a memory rule is active, each best-effort memory cgroup is held at what
                  it uses: memory.high on v2 (its allocations throttled and its own pages
                  reclaimed, nothing killed); on v1 its limit, with OOM killing disabled in it so
                  that its tasks wait at the limit instead of dying (turbonode/memory_cgroups.py)
  memory_protect  while a memory rule is active, every worker keeps its pages from reclaim: its
                  throttle carries `lock_memory` (both its processes mlock what they have mapped,
                  render/memory_lock.py; it lapses with the throttle's lease), and on v2 its cgroup
                  gets memory.min at what it uses (each ancestor at least what the workers under
                  it use together, protection being bounded by the parent's). v1 has no
                  memory.min: the lock alone is there (node SLO memory cell: turbo p99 320 ms with
                  it and the squeeze, 14596 ms plain; docs/benchmarks.md, "Memory and io pressure").

Every write goes through the journal (agent/levers/journal.py): undone on release and at stop,
restored by the next agent after a kill -9. A /proc/PID/oom_score_adj whose process has exited
is nothing to restore. The OOM guard takes every worker's pids as a callable, memory_protect
the workers (cgroup.WorkerCgroup): both act on every worker of the node.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from turbonode import caps
from turbonode.cgroups import CgroupError, slice_path
from turbonode.config import LeversConfig
from turbonode.memory_cgroups import NO_PROTECTION_V1, MemoryHierarchy

from .cgroup import WorkerCgroup, WorkerCgroups
from .journal import KnobError, KnobWrites, read_knob

OOM_GUARD_PERIOD_S = 1.0  # how often the guard looks for new processes (a restarted worker, a new job)
SQUEEZE_SLACK = 4 << 20  # bytes above its usage a squeezed cgroup is held at (it grows while we write)
SQUEEZE_TRIES = 3  # ...x4 each time the kernel refuses the limit as below the usage


def best_effort_memory_cgroups(cfg: LeversConfig) -> tuple[str, ...]:
    return tuple(cfg.memory_best_effort_cgroups or cfg.best_effort_cgroups)


def processes_under(h: MemoryHierarchy, cgroup: str) -> list[int]:
    """Every process in `cgroup` and its descendants."""
    top = h.dir(cgroup)
    if not os.path.isdir(top):
        raise CgroupError(f"cgroup {cgroup} does not exist ({top})")
    pids = []
    for directory, _, _ in os.walk(top):
        try:
            with open(os.path.join(directory, "cgroup.procs")) as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue  # removed while we walked
    return pids


class OomGuard:
    name = "oom_guard"

    def __init__(
        self,
        cfg: LeversConfig,
        writes: KnobWrites,
        worker_pids: Callable[[], Iterable[int]],
        procfs: str = "/proc",
        own: str | None = None,
        can_lower: bool | None = None,
    ):
        """`procfs`: where the worker's and the best-effort processes are (the host's /proc in a
        container); `own`: the agent's own oom_score_adj file (default: in its own /proc);
        `can_lower`: whether it may lower a value (default: whether it has CAP_SYS_RESOURCE)."""
        self.cfg, self.writes, self.worker_pids, self.procfs = cfg, writes, worker_pids, procfs
        self.own = own or f"/proc/{os.getpid()}/oom_score_adj"
        mask = caps.effective()
        self.can_lower = (mask is None or bool(mask >> caps.CAP_SYS_RESOURCE & 1)) if can_lower is None else can_lower
        self.checked_at: float | None = None
        self.error: str | None = None
        self.counts = {"worker": 0, "best_effort": 0}  # processes guarded at the last check

    def due(self, now: float) -> bool:
        return self.checked_at is None or now - self.checked_at >= OOM_GUARD_PERIOD_S

    def refresh(self, now: float) -> None:
        """Lower the worker's and our own processes' oom_score_adj, raise the best-effort ones';
        forget the processes that have exited. Problems go to `error` (reported, retried)."""
        self.checked_at = now
        errors = []
        worker = {int(p) for p in self.worker_pids()}
        lowered = [os.path.join(self.procfs, str(pid), "oom_score_adj") for pid in worker] + [self.own]
        targets = {path: (self.cfg.worker_oom_score_adj, "lower") for path in lowered if self.can_lower}
        try:
            h = MemoryHierarchy.find(self.cfg.cgroup_root)
            for cg in best_effort_memory_cgroups(self.cfg):
                for pid in processes_under(h, slice_path(cg)):
                    path = os.path.join(self.procfs, str(pid), "oom_score_adj")
                    targets.setdefault(path, (self.cfg.best_effort_oom_score_adj, "raise"))
        except CgroupError as exc:
            errors.append(f"best-effort processes: {exc}")
        for path in [p for p in self.writes.paths if not os.path.exists(p)]:
            self.writes.undo(path)  # its process has exited
        for path, (adj, direction) in targets.items():
            try:
                if self.writes.written(path) == str(adj):
                    continue
                current = int(read_knob(path))
                if (current > adj) if direction == "lower" else (current < adj):
                    self.writes.set(path, str(adj), vanishes=True)
            except (KnobError, ValueError) as exc:
                if os.path.exists(os.path.dirname(path)):  # else: its process exited meanwhile
                    errors.append(str(exc))
        self.counts = {
            "worker": len(worker),
            "best_effort": sum(1 for _, d in targets.values() if d == "raise"),
        }
        self.error = "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "") or None

    def release(self) -> list[str]:
        self.checked_at = None
        return self.writes.undo_all()

    def status(self) -> dict[str, Any]:
        return {
            "engaged": self.checked_at is not None,
            "reason": "standing while the agent runs",
            "error": self.error,
            "processes": self.counts,
            "worker_oom_score_adj": self.cfg.worker_oom_score_adj
            if self.can_lower
            else "not lowered: no CAP_SYS_RESOURCE",
            "best_effort_oom_score_adj": self.cfg.best_effort_oom_score_adj,
        }


class MemorySqueeze:
    """The `memory_squeeze` lever: each best-effort memory cgroup held at its usage while engaged."""

    name = "memory_squeeze"
    dry_run_note = "would hold the best-effort cgroups' memory where it is"

    def __init__(self, cfg: LeversConfig, writes: KnobWrites):
        self.cfg, self.writes = cfg, writes

    def engage(self) -> dict[str, Any]:
        h = MemoryHierarchy.find(self.cfg.cgroup_root)
        cgroups = best_effort_memory_cgroups(self.cfg)
        if not cgroups:
            raise CgroupError("no best-effort cgroups to squeeze (levers.memory_best_effort_cgroups)")
        held = {}
        try:
            for cg in cgroups:
                held[cg] = self._hold(h, cg)
        except (CgroupError, KnobError):
            self.writes.undo_all()  # none held rather than some
            raise
        return {"cgroup_version": h.version, "held_at_bytes": held}

    def _hold(self, h: MemoryHierarchy, cgroup: str) -> int:
        """Hold `cgroup` a little above its usage; a v1 limit below a usage that grew meanwhile is
        refused (EBUSY: it cannot reclaim a job's anonymous memory without swap), so try higher."""
        for attempt in range(SQUEEZE_TRIES):
            at = h.usage(cgroup) + SQUEEZE_SLACK * 4**attempt
            try:
                for path, value, key in h.squeeze_writes(cgroup, at):
                    self.writes.set(path, value, key)
                return at
            except KnobError:
                if attempt == SQUEEZE_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def stale(self) -> bool:
        return False  # no worker's cgroup to look for

    def release(self) -> list[str]:
        return self.writes.undo_all()


class MemoryProtect:
    """The `memory_protect` lever's knobs: every worker's memory cgroup keeps what it uses from
    reclaim (v2's memory.min; cgroup.WorkerCgroups: one not found yet leaves the others protected
    and is looked for again while engaged). Its other half, each worker's lock, rides on that
    worker's throttle (agent/levers/__init__.py), so the lever engages where memory.min cannot be
    had."""

    name = "memory_protect"
    dry_run_note = "would lock the workers' memory and protect their memory cgroups from reclaim"

    def __init__(self, cfg: LeversConfig, writes: KnobWrites, workers: Sequence[WorkerCgroup], procfs: str):
        self.cfg, self.writes = cfg, writes
        self.cgroups = WorkerCgroups(workers, procfs, lambda _: cfg.memory_worker_cgroup)

    def engage(self) -> dict[str, Any]:
        detail: dict[str, Any] = {"lock_memory": True}
        try:
            h = MemoryHierarchy.find(self.cfg.cgroup_root)
            detail["cgroup_version"] = h.version
            if h.version == 1:
                raise CgroupError(NO_PROTECTION_V1)
            found = self.cgroups.find(h)
            detail["worker_cgroups"], detail["unresolved"] = found, dict(self.cgroups.unresolved)
            if not found and not self.cgroups.unresolved:
                raise CgroupError("the workers' memory cgroups are the root or unset (levers.memory_worker_cgroup)")
            protected = {cg: h.usage(cg) for cg in dict.fromkeys(found.values())}
            for path, value in h.protect_writes(protected):
                self.writes.set(path, value)
        except (CgroupError, KnobError) as exc:
            self.writes.undo_all()
            return {**detail, "memory_min": f"not set: {exc}"}
        return {**detail, "memory_min": protected}

    def stale(self) -> bool:
        return self.cgroups.stale()

    def release(self) -> list[str]:
        self.cgroups.forget()
        return self.writes.undo_all()
