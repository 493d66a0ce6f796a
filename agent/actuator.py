"""Enforces the node-wide actions of the policy: the relax tier's lowered ceiling (a lease,
renewed every third of its TTL, that lapses in the kernel: docs/qos.md, "Leased limits") and the
node's levers the active rules engage (agent/levers/). Each worker's throttle is its own lane
(agent/throttle_lane.py). Idempotent per sample; I/O failures are reported, retried on the next
sample, and never raise into the loop. In dry-run it only logs what it would do.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from turbonode.errors import TurbonodeError

from .levers import Levers
from .policy import Actions, Reason
from .throttle_lane import RENEW_FRACTION

log = logging.getLogger("turbonode.agent")


class ClassLimits(Protocol):
    """What the actuator needs of the QoS datapath (tc.datapath.Datapath): a tier's leased limit."""

    def limit(self, tier: str, ceil_bps: int, lease_s: float) -> dict: ...

    def renew(self, tier: str, lease_s: float) -> float: ...

    def lift(self, tier: str) -> None: ...


@dataclass
class Actuator:
    ttl_s: float = 3.0
    dry_run: bool = False
    datapath: ClassLimits | None = None  # the QoS datapath, or None when no device is shaped
    relax_rate_bps: int = 0  # relax's guaranteed rate: a lowered ceiling never goes below it
    link_bps: int = 0
    levers: Levers | None = None
    counts: Counter = field(default_factory=Counter)  # (action, signal) -> n
    applied: Actions = field(default_factory=Actions)
    reason: str = "normal"
    datapath_error: str | None = None
    _ceil_done: int | None = None  # relax's leased ceiling, None while none is (as far as we know)
    _leased_at: float = 0.0

    def apply(
        self, actions: Actions, reason: str, signal: str, now: float, levers: tuple[tuple[str, Reason], ...] = ()
    ) -> None:
        """Make the node match `actions` (its relax ceil) and `levers` (lever -> the rule's reason);
        `signal` labels metrics (and the release of levers nobody wants); `reason`, the node's
        level, is kept for the status."""
        self.applied, self.reason = actions, reason
        if self.levers is not None:
            wanted = dict(levers)
            self.counts.update(
                self.levers.reconcile(
                    {name: str(r) for name, r in wanted.items()}, {name: r.signal for name, r in wanted.items()}, signal
                )
            )
        self._ceil(actions, signal, now)

    def _ceil(self, actions: Actions, signal: str, now: float) -> None:
        if self.datapath is None or not self.link_bps:
            return
        pct = actions.relax_ceil_pct
        ceil = None if pct is None else max(self.relax_rate_bps, self.link_bps * pct // 100)
        due = now - self._leased_at >= self.ttl_s * RENEW_FRACTION
        if ceil == self._ceil_done and (ceil is None or not due):
            return
        action = "relax_ceil" if ceil != self._ceil_done else "renew"
        if self.dry_run:
            if action != "renew":
                if ceil is None:
                    log.info("dry-run: would lift the relax ceil limit")
                else:
                    log.info("dry-run: would set relax ceil to %d bit/s, leased for %g s", ceil, self.ttl_s)
            self._ceil_done, self._leased_at = ceil, now
            return
        try:
            if ceil is None:
                self.datapath.lift("relax")
            elif action == "renew":
                self.datapath.renew("relax", self.ttl_s)
            else:
                self.datapath.limit("relax", ceil, self.ttl_s)
        except TurbonodeError as exc:
            if self.datapath_error != str(exc):
                log.warning("setting the relax ceil failed: %s", exc)
            self.datapath_error = str(exc)
            return
        self.datapath_error = None
        self._ceil_done, self._leased_at = ceil, now
        if action == "renew":
            log.debug("relax ceil lease renewed for %g s", self.ttl_s)
            return
        self.counts[("relax_ceil", signal)] += 1
        if ceil is None:
            log.info("relax ceil limit lifted: relax is back at its own ceil")
        else:
            log.info("relax ceil set to %d bit/s, leased for %g s at a time", ceil, self.ttl_s)

    def state(self) -> dict:
        return {
            "applied": {"relax_ceil_pct": self.applied.relax_ceil_pct},
            "reason": self.reason,
            "dry_run": self.dry_run,
            "datapath_error": self.datapath_error,
            "relax_ceil_bps": self._ceil_done,
            "levers": self.levers.status() if self.levers is not None else {},
        }
