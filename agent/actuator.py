"""Enforces the policy's actions: the worker throttle (renewed before its TTL runs out), the
relax tier's lowered ceiling (a lease too, renewed on the same schedule, that lapses in the
kernel: docs/qos.md, "Leased limits"), and the levers the active rules engage (agent/levers/;
a lever's throttle fields ride on the worker throttle). Idempotent per sample; I/O failures are
reported, retried on the next sample, and never raise into the loop. In dry-run it only logs
what it would do.

An operator's hold on the worker (`turboctl throttle --hold`) is respected: the worker refuses
our throttle and release with THROTTLE_HELD, and we keep our hands off (asking again every
renew interval) until the hold is released or expires; the hold is shown in our status.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from turbonode.errors import ControlError, TurbonodeError
from turbonode.jsonrpc import ControlClient
from turbonode.throttle_params import THROTTLE_HELD

from .levers import Levers
from .policy import Actions, Reason

log = logging.getLogger("turbonode.agent")

RENEW_FRACTION = 1 / 3  # renew after a third of the TTL: two more tries before it expires


class ClassLimits(Protocol):
    """What the actuator needs of the QoS datapath (tc.datapath.Datapath): a tier's leased limit."""

    def limit(self, tier: str, ceil_bps: int, lease_s: float) -> dict: ...

    def renew(self, tier: str, lease_s: float) -> float: ...

    def lift(self, tier: str) -> None: ...


@dataclass
class Actuator:
    worker: ControlClient | None
    ttl_s: float = 3.0
    dry_run: bool = False
    datapath: ClassLimits | None = None  # the QoS datapath, or None when no device is shaped
    relax_rate_bps: int = 0  # relax's guaranteed rate: a lowered ceiling never goes below it
    link_bps: int = 0
    levers: Levers | None = None
    counts: Counter = field(default_factory=Counter)  # (action, signal) -> n
    applied: Actions = field(default_factory=Actions)
    worker_error: str | None = None
    datapath_error: str | None = None
    worker_hold: dict | None = None  # the operator's hold in force at the worker, as it told us
    _hold_checked: float = 0.0
    _sent: dict | None = None  # throttle in force at the worker, as far as we know
    _sent_at: float = 0.0
    _ceil_done: int | None = None  # relax's leased ceiling, None while none is (as far as we know)
    _leased_at: float = 0.0

    def apply(
        self, actions: Actions, reason: str, signal: str, now: float, levers: tuple[tuple[str, Reason], ...] = ()
    ) -> None:
        """Make the world match `actions` and `levers` (lever -> the rule's reason); `reason` goes
        to the worker, `signal` labels metrics (and the release of levers nobody wants)."""
        if actions != self.applied:
            log.info("%s%s (%s)", "dry-run: would apply " if self.dry_run else "apply ", actions, reason)
        self.applied = actions
        throttle = actions.throttle
        if self.levers is not None:
            wanted = dict(levers)
            done = self.levers.reconcile(
                {name: str(r) for name, r in wanted.items()}, {name: r.signal for name, r in wanted.items()}, signal
            )
            self.counts.update(done)
            extra = self.levers.throttle_fields()
            if extra:
                if throttle is None:  # the levers alone: the worker hears their rule's reason
                    reason = self.levers.throttle_reason()
                throttle = {**(throttle or {}), **extra}
        if self.worker is not None:
            self._worker(self.worker, throttle, reason, signal, now)
        self._ceil(actions, signal, now)

    def _worker(self, worker: ControlClient, want: dict | None, reason: str, signal: str, now: float) -> None:
        held = self.worker_hold is not None
        if held and now - self._hold_checked < self.ttl_s * RENEW_FRACTION:
            return  # the operator holds the worker: ask again at the renew interval, not every sample
        fresh = now - self._sent_at < self.ttl_s * RENEW_FRACTION
        if not held and want == self._sent and (want is None or fresh):
            return
        action = "release" if want is None else "renew" if want == self._sent else "throttle"
        params = {"reason": reason} if want is None else {"reason": reason, "ttl_s": self.ttl_s, **want}
        if self.dry_run:
            if action != "renew":
                log.info("dry-run: would %s worker %s", action, params)
                self.counts[(action, signal)] += 1
        else:
            try:
                worker.call("release" if want is None else "throttle", **params)
            except ControlError as exc:  # absent or restarting worker: retried next sample
                if exc.code == THROTTLE_HELD:
                    self._held(exc.data, action, now)
                    return
                if self.worker_error != str(exc):
                    log.warning("worker %s failed: %s", action, exc)
                self.worker_error = str(exc)
                return
            self.worker_error = None
            if self.worker_hold is not None:
                log.info("the operator's hold on the worker is over: the agent throttles it again")
                self.worker_hold = None
            self.counts[(action, signal)] += 1
            log.log(logging.DEBUG if action == "renew" else logging.INFO, "worker %s %s", action, params)
        self._sent, self._sent_at = want, now

    def _held(self, data: object, action: str, now: float) -> None:
        hold = data.get("hold") if isinstance(data, dict) else None
        hold = hold if isinstance(hold, dict) else {}
        if self.worker_hold is None:
            log.warning(
                "worker held by the operator (%s): not changing its throttle (%s refused) until released or expired",
                hold.get("reason", "no reason given"),
                action,
            )
        self.worker_hold, self._hold_checked, self.worker_error = hold, now, None

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
            "applied": {"relax_ceil_pct": self.applied.relax_ceil_pct, "throttle": self.applied.throttle},
            "worker_throttle": self._sent,  # as sent: the level's throttle and the levers' fields
            "dry_run": self.dry_run,
            "worker_error": self.worker_error,
            "worker_hold": self.worker_hold,
            "datapath_error": self.datapath_error,
            "relax_ceil_bps": self._ceil_done,
            "levers": self.levers.status() if self.levers is not None else {},
        }
