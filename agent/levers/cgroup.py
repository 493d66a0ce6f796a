"""The CPU-share lever: favour the worker over co-located best-effort work while degraded.

It raises the worker's cgroup weight and lowers (optionally caps) the configured best-effort
cgroups' (a batch slice, say) on cgroup v1 or v2 (turbonode/cgroups.py). Measured on the
development VM (docs/benchmarks.md): a hog in another session gets the same CPU share as the
worker whatever its nice (sched_autogroup), and a lowered weight on the hog's cgroup alone
leaves the 2-thread tail; raising the worker's weight above its neighbours keeps its steps
at idle speed. Writes go through the KnobJournal: reversible, restored after a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turbonode.cgroups import V2_WEIGHT_MAX, V2_WEIGHT_MIN, CpuHierarchy

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
