"""Levers: reversible actions the policy engages per rule, beside the per-level throttle.

A rule of `[policy.rules.<signal>]` lists the levers it engages while it is active
(turbonode.config.LEVER_NAMES, agent/policy.py):

  cpu_share       favour the worker's cgroup over best-effort cgroups: CPU weight up for the
                  worker, down (optionally capped) for them (agent/levers/cgroup.py)
  worker_threads  the worker runs `levers.worker_threads` torch intra-op threads: a field of its
                  throttle, so it expires like the rest if the agent dies
  memory_squeeze  best-effort memory cgroups held at what they use (agent/levers/memory.py)
  memory_protect  the worker's memory cgroup kept from reclaim, on v2 (agent/levers/memory.py)
  io_weight       io weight up for the worker, down for best-effort cgroups (agent/levers/io.py)

Beside them, the OOM guard (agent/levers/memory.py) is standing while the agent runs
(`levers.oom_guard`): the worker's and the agent's oom_score_adj lowered, the best-effort
processes' raised, new processes included; released when the agent stops (`close`).

`Levers.reconcile` engages what the policy wants and releases the rest (on recovery, and all
of them when the agent stops). Kernel knobs are written through a journal on disk
(agent/levers/journal.py): the next agent after a kill -9 puts back what the dead one left,
at start, before it changes anything. A lever that fails to engage is reported (status,
log) and tried again at the next sample; it never stops the loop. In dry-run nothing is
written: what would be is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from turbonode.config import LEVER_NAMES, LeversConfig
from turbonode.errors import TurbonodeError

from .cgroup import CpuShare
from .io import IoWeight
from .journal import KnobJournal, KnobWrites
from .memory import MemoryProtect, MemorySqueeze, OomGuard

log = logging.getLogger("turbonode.agent")

THREADS = "worker_threads"
PROTECT = "memory_protect"
LEVER_STATE_FILE = "levers.json"  # in the runtime directory, beside the agent's socket


class KnobLever(Protocol):
    """A lever that writes kernel knobs through the journal (agent/levers/cgroup.py, memory.py, io.py)."""

    dry_run_note: str  # what it would do, for the dry-run log

    def engage(self) -> dict[str, Any]: ...  # what it did, for status; raises TurbonodeError

    def release(self) -> list[str]: ...  # the problems putting things back, one line each


@dataclass
class LeverState:
    engaged: bool = False
    since: float | None = None  # wall clock
    reason: str = ""
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Levers:
    def __init__(
        self,
        cfg: LeversConfig,
        state_file: str,
        worker_pid: Callable[[], int],
        procfs: str = "/proc",
        dry_run: bool = False,
        worker_pids: Callable[[], Iterable[int]] = tuple,
    ):
        self.cfg, self.dry_run = cfg, dry_run
        self.journal = KnobJournal(state_file)
        self.cpu_share = CpuShare(cfg, self.journal, worker_pid, procfs)
        # the levers that write kernel knobs, by name: engage() -> what it did, release() -> problems
        self.knobs: dict[str, KnobLever] = {
            "cpu_share": self.cpu_share,
            "memory_squeeze": MemorySqueeze(cfg, KnobWrites(self.journal)),
            "memory_protect": MemoryProtect(cfg, KnobWrites(self.journal), worker_pid, procfs),
            "io_weight": IoWeight(cfg, KnobWrites(self.journal), worker_pid, procfs),
        }
        self.oom_guard = OomGuard(cfg, KnobWrites(self.journal), worker_pids, procfs) if cfg.oom_guard else None
        self.state = {name: LeverState() for name in LEVER_NAMES}
        self.restore_problems: list[str] = []

    def restore_leftovers(self) -> list[str]:
        """What an agent killed before it could undo its levers left behind, put back (at start)."""
        if not self.dry_run:
            self.restore_problems = self.journal.restore_leftovers()
            for problem in self.restore_problems:
                log.warning("restoring what a previous agent changed: %s", problem)
        return self.restore_problems

    def reconcile(self, wanted: Mapping[str, str], signals: Mapping[str, str], why_released: str) -> list[tuple]:
        """Engage the levers in `wanted` (lever -> reason), release the others; the (action, signal)
        pairs done, for the actuator's counters. `signals` labels each wanted lever's cause."""
        self._guard()
        done = []
        for name, st in self.state.items():
            if name in wanted and not st.engaged:
                if self._engage(name, wanted[name]):
                    done.append((f"{name}_engage", signals.get(name, "")))
            elif name not in wanted and st.engaged:
                self._release(name, why_released)
                done.append((f"{name}_release", why_released))
        return done

    def _guard(self) -> None:
        guard = self.oom_guard
        if guard is None or not guard.due(time.monotonic()):
            return
        if self.dry_run:
            if guard.checked_at is None:
                log.info(
                    "dry-run: would set oom_score_adj of the worker and the agent to %d, of best-effort "
                    "processes to %d",
                    self.cfg.worker_oom_score_adj,
                    self.cfg.best_effort_oom_score_adj,
                )
            guard.checked_at = time.monotonic()
            return
        was = guard.error
        guard.refresh(time.monotonic())
        if guard.error != was and guard.error:
            log.warning("oom guard: %s", guard.error)

    def close(self) -> list[str]:
        """Release what is standing (the OOM guard) when the agent stops; the problems."""
        if self.oom_guard is None or self.dry_run:
            return []
        problems = self.oom_guard.release()
        for problem in problems:
            log.warning("oom guard: %s", problem)
        return problems

    def _engage(self, name: str, reason: str) -> bool:
        st = self.state[name]
        try:
            detail = {} if name == THREADS else self._engage_knobs(name)
        except TurbonodeError as exc:
            if st.error != str(exc):
                log.warning("lever %s could not be engaged (%s): %s", name, reason, exc)
            st.error = str(exc)
            return False
        st.engaged, st.since, st.reason, st.error, st.detail = True, time.time(), reason, None, detail
        log.info("%slever %s engaged (%s) %s", "dry-run: " if self.dry_run else "", name, reason, detail or "")
        return True

    def _engage_knobs(self, name: str) -> dict[str, Any]:
        if self.dry_run:
            return {"dry_run": self.knobs[name].dry_run_note}
        return self.knobs[name].engage()

    def _release(self, name: str, why: str) -> None:
        problems = [] if name == THREADS or self.dry_run else self.knobs[name].release()
        for problem in problems:
            log.warning("lever %s: %s", name, problem)
        log.info("%slever %s released (%s)", "dry-run: " if self.dry_run else "", name, why)
        self.state[name] = LeverState(error="; ".join(problems) or None)

    def throttle_fields(self) -> dict[str, Any]:
        """What the engaged levers add to the worker's throttle."""
        out: dict[str, Any] = {}
        if self.state[THREADS].engaged:
            out["intra_op_threads"] = self.cfg.worker_threads
        if self.state[PROTECT].engaged:
            out["lock_memory"] = True  # render/memory_lock.py: lapses with the throttle
        return out

    def throttle_reason(self) -> str:
        """Why the throttle is set when only levers ask for it: the first such lever's reason."""
        return next(self.state[n].reason for n in (THREADS, PROTECT) if self.state[n].engaged)

    def engaged(self) -> dict[str, bool]:
        return {name: st.engaged for name, st in self.state.items()}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: {"engaged": st.engaged, "since": st.since, "reason": st.reason, "error": st.error, **st.detail}
            for name, st in self.state.items()
        }
        out["oom_guard"] = self.oom_guard.status() if self.oom_guard is not None else {"engaged": False}
        out["changed"] = self.journal.changed()
        out["restore_problems"] = self.restore_problems
        return out
