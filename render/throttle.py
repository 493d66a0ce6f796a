"""The throttle the agent sets over the control socket: validated, replaced whole, expiring.

A throttle is a lease: it lasts `ttl_s` unless the agent renews it by setting it again, so
a dead agent never leaves the worker throttled. Its limits are checked by
turbonode.throttle_params, the same check the agent's config passes: turbo can never be
paused, shed or capped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from turbonode.throttle_params import ThrottleLimits, check_throttle

MAX_TTL_S = 3600.0


@dataclass(frozen=True)
class Throttle(ThrottleLimits):
    reason: str = ""
    ttl_s: float = 0.0
    set_at: float = 0.0  # monotonic
    set_at_wall: float = 0.0

    @property
    def expires_at(self) -> float:
        return self.set_at + self.ttl_s

    def describe(self, now: float) -> dict:
        return {
            "max_batch": self.max_batch,
            "paused_tiers": sorted(self.paused_tiers),
            "step_caps": dict(self.step_caps),
            "shed_tiers": sorted(self.shed_tiers),
            "reason": self.reason,
            "ttl_s": self.ttl_s,
            "expires_at": self.set_at_wall + self.ttl_s,
            "expires_in_s": round(max(0.0, self.expires_at - now), 3),
        }


def make_throttle(
    *,
    max_batch=None,
    paused_tiers=(),
    step_caps=None,
    shed_tiers=(),
    reason="",
    ttl_s=None,
    now: float,
    now_wall: float,
) -> Throttle:
    """Validate the `throttle` call's parameters; ValueError names the bad one."""
    limits = check_throttle(max_batch, paused_tiers, step_caps, shed_tiers)
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("reason must be a non-empty string (it is logged and shown in status)")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}], got {ttl_s!r}")
    return Throttle(
        limits.max_batch,
        limits.paused_tiers,
        limits.step_caps,
        limits.shed_tiers,
        reason.strip(),
        float(ttl_s),
        now,
        now_wall,
    )


class ThrottleState:
    """The current throttle, if any; expiry is checked on every read."""

    def __init__(self, clock=time.monotonic, wall=time.time):
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._current: Throttle | None = None
        self.expired_total = 0

    def set(self, **params) -> Throttle:
        throttle = make_throttle(now=self._clock(), now_wall=self._wall(), **params)
        with self._lock:
            self._current = throttle
        return throttle

    def release(self) -> Throttle | None:
        with self._lock:
            old, self._current = self._current, None
        return old

    def current(self) -> Throttle | None:
        with self._lock:
            if self._current is not None and self._clock() >= self._current.expires_at:
                self._current = None
                self.expired_total += 1
            return self._current

    def now(self) -> float:
        return self._clock()
