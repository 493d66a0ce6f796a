"""One agent step: sample every watcher, let the policy decide, enforce, publish a snapshot.

The snapshot is the agent's status object: the level and why, every signal, each watcher's
summary and the sections each watcher contributes (Watcher.status_view).

No sockets or threads of its own: the daemon calls step() on its schedule, the status
socket and the metrics read the snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from turbonode.levels import LEVELS

from .actuator import Actuator
from .policy import Actions, Decision, DegradationPolicy
from .watchers.base import Watcher

log = logging.getLogger("turbonode.agent")

# Status sections that a watcher fills in (Watcher.status_view): what they say while it does not run.
UNWATCHED: dict[str, object] = {"qos": {}, "worker": {"state": "not watched"}}


@dataclass
class AgentLoop:
    watchers: list[Watcher]
    policy: DegradationPolicy
    actions: dict[int, Actions]
    actuator: Actuator
    sample_period: float = 0.25
    last_change: Decision | None = None
    last_change_wall: float | None = None
    _snapshot: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self, now: float) -> Decision:
        fresh: dict = {}
        for w in self.watchers:
            fresh.update(w.sample(now))
        decision = self.policy.update(fresh, now)
        if decision.changed:
            self.last_change, self.last_change_wall = decision, time.time()
            log.log(
                logging.WARNING if decision.level > decision.previous else logging.INFO, "level %s", decision.describe()
            )
        else:
            log.debug("level %s", decision.describe())
        last = self.last_change
        up = last is not None and last.level > last.previous
        cause = last.reasons[0].signal if last is not None and up else "recovery"  # metrics label
        reason = last.describe() if last is not None else "normal"
        self.actuator.apply(self.actions[decision.level], reason, cause, now, decision.levers)
        self._publish(decision)
        return decision

    def _publish(self, decision: Decision) -> None:
        signals = {k: v for w in self.watchers for k, v in w.signals.items()}  # slow watchers: last read
        snap = {
            "level": decision.level_name,
            "level_index": decision.level,
            "active": [r.as_dict() for r in decision.reasons if r.crossed != "below exit"],
            "last_change": None
            if self.last_change is None
            else {
                "at": self.last_change_wall,
                "from": LEVELS[self.last_change.previous],
                "to": self.last_change.level_name,
                "reasons": [r.as_dict() for r in self.last_change.reasons],
            },
            "signals": signals,
            "rules": self.policy.snapshot(),
            "watchers": {w.name: w.summary() for w in self.watchers},
            "actions": self.actuator.state(),
            **UNWATCHED,
            "sample_period_s": self.sample_period,
        }
        for w in self.watchers:
            snap.update(w.status_view())
        with self._lock:
            self._snapshot = snap

    def status(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def metrics_state(self) -> tuple[int, dict, dict[str, bool]]:
        levers = self.actuator.levers
        return self.policy.level, dict(self.actuator.counts), levers.engaged() if levers is not None else {}
