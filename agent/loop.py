"""One agent step: sample the node's watchers, let the node's rules decide, then each worker
(its own watchers and rules, agent/worker_unit.py), enforce, publish a snapshot.

The node's level (the rules on node-wide signals: CPU, softirq, PSI, ...) drives what is the
node's: the relax tier's ceiling and the node's levers (cpu_share). Each worker's level is the
higher of the node's and its own rules', and drives its throttle. The snapshot is the agent's
status object: the highest level and the node's, every node signal, each watcher's summary, the
sections the node's watchers contribute (Watcher.status_view) and each worker's own
(`workers.<name>`).

No sockets or threads of its own: the daemon calls step() on its schedule, the status socket and
the metrics read the snapshot. Every call to a worker happens in that worker's feed or lane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from turbonode.levels import LEVELS

from .actuator import Actuator
from .levers import NODE_LEVERS
from .policy import Actions, Decision, DegradationPolicy, Reason
from .watchers.base import Watcher
from .worker_unit import WorkerUnit, cause_of

log = logging.getLogger("turbonode.agent")

# Status sections that a node watcher fills in (Watcher.status_view): what they say while it does not run.
UNWATCHED: dict[str, object] = {"qos": {}}
STOP_REASON = "agent stopping"


@dataclass
class AgentLoop:
    watchers: list[Watcher]  # the node's
    policy: DegradationPolicy  # the rules on the node's signals
    actions: dict[int, Actions]
    actuator: Actuator  # the node's actions: relax ceil, node levers
    workers: list[WorkerUnit]
    sample_period: float = 0.25
    last_change: Decision | None = None  # the node's
    last_change_wall: float | None = None
    changed: bool = False  # whether the last step changed any level
    _snapshot: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def all_watchers(self) -> list[Watcher]:
        return [*self.watchers, *(w for u in self.workers for w in u.watchers)]

    def step(self, now: float) -> Decision:
        """One sample of everything; returns the node's decision."""
        fresh: dict = {}
        for w in self.watchers:
            fresh.update(w.sample(now))
        decision = self.policy.update(fresh, now)
        if decision.changed:
            self.last_change, self.last_change_wall = decision, time.time()
            up = decision.level > decision.previous
            log.log(logging.WARNING if up else logging.INFO, "node: level %s", decision.describe())
        else:
            log.debug("node: level %s", decision.describe())
        node_levers = decision.levers
        # a node lever a worker's own rule wants is engaged too (for the node: it acts on the node)
        wanted: dict[str, Reason] = {}
        for lever, why in node_levers:
            wanted.setdefault(lever, why)
        changed = decision.changed
        for unit in self.workers:
            own = unit.step(decision, node_levers, self.actions, now)
            changed |= own.changed
            for lever, why in own.levers:
                wanted.setdefault(lever, why)
        cause, reason = cause_of(self.last_change)
        node_wanted = tuple((k, r) for k, r in wanted.items() if k in NODE_LEVERS)
        self.actuator.apply(self.actions[decision.level], reason, cause, now, node_wanted)
        self.changed = changed
        self._publish(decision)
        return decision

    def top_level(self) -> int:
        return max([self.policy.level, *(u.level for u in self.workers)])

    def describe(self) -> str:
        """The levels, for `systemctl status`: 'level pressured' or, with several workers,
        'level critical (gpu0 critical, gpu1 pressured)'."""
        text = f"level {LEVELS[self.top_level()]}"
        if len(self.workers) > 1:
            text += " (" + ", ".join(f"{u.name} {LEVELS[u.level]}" for u in self.workers) + ")"
        return text

    def _publish(self, decision: Decision) -> None:
        signals = {k: v for w in self.watchers for k, v in w.signals.items()}  # slow watchers: last read
        top = self.top_level()
        node_active = [r.as_dict() for r in decision.reasons if r.crossed != "below exit"]
        workers = {u.name: u.status() for u in self.workers}
        node_rules = self.policy.snapshot()
        snap = {
            "level": LEVELS[top],  # the highest on the node: a worker's, which includes the node's
            "level_index": top,
            "node": {"level": decision.level_name, "level_index": decision.level},
            # the node's active rules, then each worker's own
            "active": node_active
            + [
                {**r, "worker": name}
                for name, w in workers.items()
                for r in w["active"]
                if r["signal"] not in node_rules
            ],
            "last_change": None if self.last_change is None else self.last_change.change(self.last_change_wall or 0),
            "signals": signals,
            "rules": node_rules,
            "watchers": {w.name: w.summary() for w in self.watchers},
            "actions": self.actuator.state(),
            **UNWATCHED,
            "workers": workers,
            "sample_period_s": self.sample_period,
        }
        for w in self.watchers:
            snap.update(w.status_view())
        with self._lock:
            self._snapshot = snap

    def status(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def shutdown(self, now: float, timeout: float) -> None:
        """Release every worker (each by its lane, all at once, within `timeout`) and the node's
        actions: nothing stays degraded behind a stopped agent."""
        for unit in self.workers:
            unit.release(STOP_REASON)
        self.actuator.apply(Actions(), STOP_REASON, "shutdown", now)
        deadline = time.monotonic() + timeout
        for unit in self.workers:
            unit.lane.close(deadline)

    def metrics_state(self) -> tuple[dict[str, int], Counter, dict[tuple[str, str], bool]]:
        """(worker -> level, (action, signal, worker) -> n, (lever, worker) -> engaged); the node's
        own actions and levers have worker ''."""
        counts: Counter = Counter({(a, s, ""): n for (a, s), n in self.actuator.counts.items()})
        levers = {(name, ""): on for name, on in self.actuator.levers.engaged().items()} if self.actuator.levers else {}
        for u in self.workers:
            counts.update({(a, s, u.name): n for (a, s), n in u.counts().items()})
            levers.update({(name, u.name): on for name, on in u.levers.engaged().items()})
        return {u.name: u.level for u in self.workers}, counts, levers
