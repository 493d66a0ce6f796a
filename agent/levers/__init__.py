"""Levers: reversible actions the policy engages per rule, beside the per-level throttle.

A rule of `[policy.rules.<signal>]` lists the levers it engages while it is active
(turbonode.config.levers.LEVER_NAMES, agent/policy.py). A lever acts on the node or on one worker:

  cpu_share       (node) favour every worker's cgroup over best-effort cgroups: CPU weight up for
                  the workers, down (optionally capped) for them (agent/levers/cgroup.py)
  worker_threads  (one worker) the worker runs `levers.worker_threads` torch intra-op threads: a
                  field of its throttle, so it expires like the rest if the agent dies
  memory_squeeze  (node) best-effort memory cgroups held at what they use (agent/levers/memory.py)
  memory_protect  (node, and each worker) every worker's memory cgroup kept from reclaim, on v2
                  (agent/levers/memory.py), and each worker told to lock its memory (a field of
                  its throttle: render/memory_lock.py)
  io_weight       (node) io weight up for every worker, down for best-effort cgroups; where no
                  proportional io policy schedules a disk, the best-effort writes to it capped
                  instead, or off, saying why (agent/levers/io.py, io_policy.py)
  io_throttle     (node) best-effort cgroups' writes capped per disk (agent/levers/io.py)

Beside them, the OOM guard (agent/levers/memory.py) is standing while the agent runs
(`levers.oom_guard`): the workers' and the agent's oom_score_adj lowered, the best-effort
processes' raised, new processes included; released when the agent stops (`close`).

`Levers` holds the node's, `WorkerLevers` one worker's; `reconcile` engages what the policy
wants and releases the rest (on recovery, and all of them when the agent stops). Kernel knobs
are written through a journal on disk (agent/levers/journal.py): the next agent after a kill -9
puts back what the dead one left, at start, before it changes anything. A lever that fails to
engage is reported (status, log) and tried again at the next sample; it never stops the loop.
In dry-run nothing is written: what would be is logged.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turbonode.config.levers import LEVER_NAMES, LeversConfig
from turbonode.errors import TurbonodeError

from .cgroup import CpuShare, WorkerCgroup
from .io import IoThrottle, IoWeight
from .io_policy import IO_MODES
from .journal import KnobJournal, KnobWrites
from .memory import MemoryProtect, MemorySqueeze, OomGuard
from .writers import CGROUPFS, SYSTEMD, WRITERS, CgroupfsWriter, choose_writer, unit_of_cgroup

log = logging.getLogger("turbonode.agent")

THREADS = "worker_threads"
PROTECT = "memory_protect"
# levers that act on one worker (through its throttle), and those with knobs of the node:
# memory_protect is both (each worker's lock, every worker's memory.min)
WORKER_LEVERS = (THREADS, PROTECT)
NODE_LEVERS = tuple(name for name in LEVER_NAMES if name != THREADS)
LEVER_STATE_FILE = "levers.json"  # in the runtime directory, beside the agent's socket


class KnobLever(Protocol):
    """A lever that writes kernel knobs through the journal (agent/levers/cgroup.py, memory.py, io.py)."""

    dry_run_note: str  # what it would do, for the dry-run log

    def engage(self) -> dict[str, Any]: ...  # what it did, for status; raises TurbonodeError

    def release(self) -> list[str]: ...  # the problems putting things back, one line each

    def stale(self) -> bool: ...  # engaged without some worker's cgroup, due to look for it again


@dataclass
class LeverState:
    engaged: bool = False
    since: float | None = None  # wall clock
    reason: str = ""
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class LeverSet:
    """Levers by name, each engaged while a rule wants it; subclasses do what engaging means."""

    names: tuple[str, ...] = ()
    where = "node"  # for the log

    def __init__(self, dry_run: bool = False):
        self.dry_run = dry_run
        self.state = {name: LeverState() for name in self.names}

    def reconcile(self, wanted: Mapping[str, str], signals: Mapping[str, str], why_released: str) -> list[tuple]:
        """Engage the levers in `wanted` (lever -> reason), release the others; the (action, signal)
        pairs done, for the actuator's counters. `signals` labels each wanted lever's cause."""
        done = []
        for name, st in self.state.items():
            if name in wanted and not st.engaged:
                if self._engage(name, wanted[name]):
                    done.append((f"{name}_engage", signals.get(name, "")))
            elif name in wanted:
                self._refresh(name)
            elif st.engaged:
                self._release(name, why_released)
                done.append((f"{name}_release", why_released))
        return done

    def _engage(self, name: str, reason: str) -> bool:
        st = self.state[name]
        try:
            detail = self._engage_knobs(name)
        except TurbonodeError as exc:
            if st.error != str(exc):
                log.warning("%s: lever %s could not be engaged (%s): %s", self.where, name, reason, exc)
            st.error = str(exc)
            return False
        st.engaged, st.since, st.reason, st.error, st.detail = True, time.time(), reason, None, detail
        prefix = "dry-run: " if self.dry_run else ""
        log.info("%s%s: lever %s engaged (%s) %s", prefix, self.where, name, reason, detail or "")
        return True

    def _release(self, name: str, why: str) -> None:
        problems = self._release_knobs(name)
        for problem in problems:
            log.warning("%s: lever %s: %s", self.where, name, problem)
        log.info("%s%s: lever %s released (%s)", "dry-run: " if self.dry_run else "", self.where, name, why)
        self.state[name] = LeverState(error="; ".join(problems) or None)

    def _engage_knobs(self, name: str) -> dict[str, Any]:
        """What engaging `name` changed (raises TurbonodeError when it cannot)."""
        return {}

    def _refresh(self, name: str) -> None:
        """An engaged lever, still wanted: catch up with what changed (a worker that came up)."""

    def _release_knobs(self, name: str) -> list[str]:
        """Undo what engaging changed; the problems, one line each."""
        return []

    def engaged(self) -> dict[str, bool]:
        return {name: st.engaged for name, st in self.state.items()}

    def status(self) -> dict[str, Any]:
        return {
            name: {"engaged": st.engaged, "since": st.since, "reason": st.reason, "error": st.error, **st.detail}
            for name, st in self.state.items()
        }


class Levers(LeverSet):
    """The node's levers: kernel knobs, written through the journal."""

    names = NODE_LEVERS

    def __init__(
        self,
        cfg: LeversConfig,
        state_file: str,
        workers: Sequence[WorkerCgroup],
        procfs: str = "/proc",
        dry_run: bool = False,
        worker_pids: Callable[[], Iterable[int]] = tuple,
        sysfs: str = "/sys",
        writer: CgroupfsWriter | None = None,
    ):
        """`writer`: who applies the knobs (agent/levers/writers.py; default: as the host is)."""
        super().__init__(dry_run)
        self.cfg, self.procfs, self.workers = cfg, procfs, tuple(workers)
        self.writer = writer or choose_writer(procfs, cfg.cgroup_root)
        self.journal = KnobJournal(state_file, self.writer)
        self.cpu_share = CpuShare(cfg, self.journal, workers, procfs)
        # the levers that write kernel knobs, by name: engage() -> what it did, release() -> problems
        self.knobs: dict[str, KnobLever] = {
            "cpu_share": self.cpu_share,
            "memory_squeeze": MemorySqueeze(cfg, KnobWrites(self.journal)),
            "memory_protect": MemoryProtect(cfg, KnobWrites(self.journal), workers, procfs),
        }
        # one writer of the write caps: io_weight caps through it where weights do nothing (agent/levers/io.py)
        self.io_throttle = IoThrottle(cfg, KnobWrites(self.journal), procfs, sysfs, self.writer.enables)
        self.io_weight = IoWeight(cfg, KnobWrites(self.journal), workers, procfs, self.io_throttle, sysfs)
        self.knobs["io_weight"], self.knobs["io_throttle"] = self.io_weight, self.io_throttle
        self.oom_guard = OomGuard(cfg, KnobWrites(self.journal), worker_pids, procfs) if cfg.oom_guard else None
        self.restore_problems: list[str] = []

    def restore_leftovers(self) -> list[str]:
        """What an agent killed before it could undo its levers left behind, put back (at start)."""
        if not self.dry_run:
            self.restore_problems = self.journal.restore_leftovers()
            for problem in self.restore_problems:
                log.warning("restoring what a previous agent changed: %s", problem)
        return self.restore_problems

    def reconcile(self, wanted: Mapping[str, str], signals: Mapping[str, str], why_released: str) -> list[tuple]:
        self._guard()
        return super().reconcile(wanted, signals, why_released)

    def _guard(self) -> None:
        guard = self.oom_guard
        if guard is None or not guard.due(time.monotonic()):
            return
        if self.dry_run:
            if guard.checked_at is None:
                log.info(
                    "dry-run: would set oom_score_adj of the workers and the agent to %d, of best-effort "
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

    def _engage_knobs(self, name: str) -> dict[str, Any]:
        if self.dry_run:
            return {"dry_run": self.knobs[name].dry_run_note}
        return self.knobs[name].engage()

    def _refresh(self, name: str) -> None:
        lever = self.knobs[name]
        if self.dry_run or not lever.stale():
            return
        try:
            self.state[name].detail = lever.engage()
        except TurbonodeError as exc:
            log.warning("node: lever %s: looking again for the workers' cgroups: %s", name, exc)

    def _release_knobs(self, name: str) -> list[str]:
        return [] if self.dry_run else self.knobs[name].release()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = super().status()
        out["oom_guard"] = self.oom_guard.status() if self.oom_guard is not None else {"engaged": False}
        out["io_weight"]["io_policy"] = self.io_weight.policy()  # engaged or not: what it can do here
        out["writer"] = {**self.writer.status(), "workers": self.worker_units()}
        out["changed"] = self.journal.changed()
        out["restore_problems"] = self.restore_problems
        return out

    def modes(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """lever -> (the mode it has on this host, the modes it can have), for turbonode_lever_mode."""
        return {
            "io_weight": (self.io_weight.policy()["mode"], IO_MODES),
            "writer": (self.writer.backend, WRITERS),
        }

    def worker_units(self) -> dict[str, dict[str, Any]]:
        """Each worker's v2 cgroup (its pid's `0::` line), the unit it is, and so whom the levers
        change it through: systemd for a unit's own cgroup under the systemd writer, else the files."""
        out: dict[str, dict[str, Any]] = {}
        for w in self.workers:
            pid = w.pid()
            if pid is None:
                out[w.name] = {"cgroup": None, "unit": None, "through": "not known yet (no pid)"}
                continue
            try:
                with open(os.path.join(self.procfs, str(pid), "cgroup")) as f:
                    lines = f.read().splitlines()
            except OSError as exc:
                out[w.name] = {"cgroup": None, "unit": None, "through": f"unknown: {exc.strerror or exc}"}
                continue
            cgroup = next((line[3:] for line in lines if line.startswith("0::")), None)
            unit, below = unit_of_cgroup(cgroup or "")
            through = SYSTEMD if unit is not None and self.writer.backend == SYSTEMD else CGROUPFS
            out[w.name] = {"cgroup": cgroup, "unit": unit, "below_a_unit": below, "through": through}
        return out


class WorkerLevers(LeverSet):
    """One worker's levers (WORKER_LEVERS): fields of its throttle, so they lapse with it."""

    names = WORKER_LEVERS

    def __init__(self, cfg: LeversConfig, worker: str, dry_run: bool = False):
        super().__init__(dry_run)
        self.cfg, self.where = cfg, f"worker {worker}"

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
        return next(self.state[n].reason for n in WORKER_LEVERS if self.state[n].engaged)
