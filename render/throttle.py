"""The throttle the agent sets over the control socket: validated, replaced whole, expiring.

A throttle is a lease: it lasts `ttl_s` unless the agent renews it by setting it again, so
a dead agent never leaves the worker throttled. Its limits are checked by
turbonode.throttle_params, the same check the agent's config passes: turbo can never be
paused, shed or capped.

An operator's throttle may be a *hold* (`hold: true`): until it is released with `hold: true`
or expires, a throttle or release without `hold` (the agent's) is refused with Held, so the
agent's next decision cannot silently replace what the operator set (docs/design.md).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from turbonode.throttle_params import MAX_THROTTLE_TTL_S, ThrottleLimits, check_throttle, check_ttl

log = logging.getLogger(__name__)

MAX_HOLD_TTL_S = 86400.0  # an operator's hold may last a working day; it still expires


class Held(Exception):
    """An operator hold is in force: only a `hold` throttle or release may change it."""

    def __init__(self, hold: Throttle):
        super().__init__(f"an operator hold is in force ({hold.reason!r})")
        self.hold = hold


@dataclass(frozen=True)
class Throttle(ThrottleLimits):
    reason: str = ""
    ttl_s: float = 0.0
    set_at: float = 0.0  # monotonic
    set_at_wall: float = 0.0
    hold: bool = False  # an operator's hold: the agent's throttle and release are refused

    @property
    def expires_at(self) -> float:
        return self.set_at + self.ttl_s

    def describe(self, now: float) -> dict:
        return {
            **self.describe_limits(),
            "reason": self.reason,
            "ttl_s": self.ttl_s,
            "expires_at": self.set_at_wall + self.ttl_s,
            "expires_in_s": round(max(0.0, self.expires_at - now), 3),
            "hold": self.hold,
        }


def make_throttle(*, reason="", ttl_s=None, hold=False, now: float, now_wall: float, **limits) -> Throttle:
    """Validate the `throttle` call's parameters (`limits`: ThrottleLimits' fields); ValueError
    names the bad one, TypeError an unknown one."""
    checked = check_throttle(**limits)
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("reason must be a non-empty string (it is logged and shown in status)")
    if not isinstance(hold, bool):
        raise ValueError(f"hold must be true or false, got {hold!r}")
    try:
        ttl_s = check_ttl(ttl_s, MAX_HOLD_TTL_S if hold else MAX_THROTTLE_TTL_S)
    except ValueError as exc:
        raise ValueError(f"ttl_s {exc}") from None
    return Throttle(**checked.limits(), reason=reason.strip(), ttl_s=ttl_s, set_at=now, set_at_wall=now_wall, hold=hold)


class ThrottleState:
    """The current throttle, if any; expiry is checked on every read. Changes are logged at
    INFO (set with new limits, released, expired); the agent's renewals of the same limits,
    every third of the TTL, at DEBUG."""

    def __init__(self, clock=time.monotonic, wall=time.time):
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._current: Throttle | None = None
        self.expired_total = 0

    def set(self, **params) -> Throttle:
        """Replace the throttle; raises Held if an operator hold is in force and this is not one."""
        throttle = make_throttle(now=self._clock(), now_wall=self._wall(), **params)
        with self._lock:
            previous = self._check_hold(throttle.hold)
            self._current = throttle
        renewed = previous is not None and previous.limits() == throttle.limits() and previous.hold == throttle.hold
        log.log(
            logging.DEBUG if renewed else logging.INFO,
            "%s %s: %s",
            "operator hold" if throttle.hold else "throttle",
            "renewed" if renewed else "set",
            throttle.describe(self._clock()),
        )
        return throttle

    def release(self, hold: bool = False) -> Throttle | None:
        """Lift the throttle; an operator hold only with `hold` (else Held)."""
        with self._lock:
            old = self._check_hold(hold)
            self._current = None
        return old

    def _check_hold(self, hold: bool) -> Throttle | None:
        current = self._live()
        if current is not None and current.hold and not hold:
            raise Held(current)
        return current

    def current(self) -> Throttle | None:
        with self._lock:
            return self._live()

    def adopt(self, throttle: Throttle | None) -> None:
        """Take the front's throttle as it is (render/engine/host.py): checked and logged there."""
        with self._lock:
            self._current = throttle

    def _live(self) -> Throttle | None:
        """The current throttle, dropping (and logging) an expired one; call with the lock held."""
        t = self._current
        if t is not None and self._clock() >= t.expires_at:
            self._current = None
            self.expired_total += 1
            log.info("throttle expired: not renewed within %g s (%s)", t.ttl_s, t.reason)
        return self._current

    def now(self) -> float:
        return self._clock()
