"""One agent step: sample every watcher, let the policy decide, enforce, publish a snapshot.

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
            log.log(logging.WARNING if decision.level > decision.previous else logging.INFO,
                    "level %s", decision.describe())
        else:
            log.debug("level %s", decision.describe())
        up = self.last_change is not None and self.last_change.level > self.last_change.previous
        cause = self.last_change.reasons[0].signal if up else "recovery"   # metrics label
        reason = self.last_change.describe() if self.last_change else "normal"
        self.actuator.apply(self.actions[decision.level], reason, cause, now)
        self._publish(decision)
        return decision

    def _publish(self, decision: Decision) -> None:
        by_name = {w.name: w for w in self.watchers}
        signals = {k: v for w in self.watchers for k, v in w.signals.items()}   # slow watchers: last read
        snap = {
            "level": decision.level_name,
            "level_index": decision.level,
            "active": [r.as_dict() for r in decision.reasons if r.crossed != "below exit"],
            "last_change": None if self.last_change is None else {
                "at": self.last_change_wall, "from": LEVELS[self.last_change.previous],
                "to": self.last_change.level_name, "reasons": [r.as_dict() for r in self.last_change.reasons]},
            "signals": signals,
            "rules": self.policy.snapshot(),
            "watchers": {w.name: w.summary() for w in self.watchers},
            "actions": self.actuator.state(),
            "qos": by_name["htb"].detail.get("tiers", {}) if "htb" in by_name else {},
            "worker": self._worker_view(by_name.get("worker")),
            "sample_period_s": self.sample_period,
        }
        with self._lock:
            self._snapshot = snap

    def _worker_view(self, w: Watcher | None) -> dict:
        if w is None:
            return {"state": "not watched"}
        if not w.ok:
            return {"state": "absent", "error": w.error}
        d = w.detail
        return {"state": "ok", "tiers": d.get("tiers"), "throttle": d.get("throttle"),
                "max_batch": d.get("max_batch"), "step_time_s": d.get("step_time_s"), "backend": d.get("backend")}

    def status(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def metrics_state(self) -> tuple[int, dict]:
        return self.policy.level, dict(self.actuator.counts)
