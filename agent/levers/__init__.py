"""Levers: reversible actions the policy engages per rule, beside the per-level throttle.

A rule of `[policy.rules.<signal>]` lists the levers it engages while it is active
(turbonode.config.LEVER_NAMES, agent/policy.py):

  cpu_share       favour the worker's cgroup over best-effort cgroups: CPU weight up for the
                  worker, down (optionally capped) for them (agent/levers/cgroup.py)
  worker_threads  the worker runs `levers.worker_threads` torch intra-op threads: a field of its
                  throttle, so it expires like the rest if the agent dies

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turbonode.config import LEVER_NAMES, LeversConfig
from turbonode.errors import TurbonodeError

from .cgroup import CpuShare
from .journal import KnobJournal

log = logging.getLogger("turbonode.agent")

THREADS = "worker_threads"
LEVER_STATE_FILE = "levers.json"  # in the runtime directory, beside the agent's socket


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
    ):
        self.cfg, self.dry_run = cfg, dry_run
        self.journal = KnobJournal(state_file)
        self.cpu_share = CpuShare(cfg, self.journal, worker_pid, procfs)
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
        done = []
        for name, st in self.state.items():
            if name in wanted and not st.engaged:
                if self._engage(name, wanted[name]):
                    done.append((f"{name}_engage", signals.get(name, "")))
            elif name not in wanted and st.engaged:
                self._release(name, why_released)
                done.append((f"{name}_release", why_released))
        return done

    def _engage(self, name: str, reason: str) -> bool:
        st = self.state[name]
        try:
            detail = {} if name == THREADS else self._engage_knobs()
        except TurbonodeError as exc:
            if st.error != str(exc):
                log.warning("lever %s could not be engaged (%s): %s", name, reason, exc)
            st.error = str(exc)
            return False
        st.engaged, st.since, st.reason, st.error, st.detail = True, time.time(), reason, None, detail
        log.info("%slever %s engaged (%s) %s", "dry-run: " if self.dry_run else "", name, reason, detail or "")
        return True

    def _engage_knobs(self) -> dict[str, Any]:
        if self.dry_run:
            return {"dry_run": "would raise the worker's CPU weight and lower the best-effort cgroups'"}
        return self.cpu_share.engage()

    def _release(self, name: str, why: str) -> None:
        problems = [] if name == THREADS or self.dry_run else self.cpu_share.release()
        for problem in problems:
            log.warning("lever %s: %s", name, problem)
        log.info("%slever %s released (%s)", "dry-run: " if self.dry_run else "", name, why)
        self.state[name] = LeverState(error="; ".join(problems) or None)

    def throttle_fields(self) -> dict[str, int]:
        """What the engaged levers add to the worker's throttle."""
        return {"intra_op_threads": self.cfg.worker_threads} if self.state[THREADS].engaged else {}

    def engaged(self) -> dict[str, bool]:
        return {name: st.engaged for name, st in self.state.items()}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: {"engaged": st.engaged, "since": st.since, "reason": st.reason, "error": st.error, **st.detail}
            for name, st in self.state.items()
        }
        out["changed"] = self.journal.changed()
        out["restore_problems"] = self.restore_problems
        return out
