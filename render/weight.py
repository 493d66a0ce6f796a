"""The worker's weight for a balancer: how much slower its denoising steps run now than its own usual pace.

Readiness (render/front/readiness.py) says whether a worker can meet a tier's objective; a worker that
still meets it at twice its usual step time stays ready, and a balancer that only knows "ready"
keeps sending it its share of turbo, which then makes the fleet's tail. The weight says how
well: HAProxy's agent-check (deploy/haproxy/turbonode.cfg) asks each worker for it every
agent-inter, as a percentage of the server's configured weight, and the turbo backend's
weighted round-robin shares requests in proportion: a worker at 1 % (2 of a configured weight
256) beside two at 100 % gets one request in 257. The weights are relative: when every worker
is slow, all are at the floor and share the load as before (the floor is never 0, which would
drain the server).

The measure is the worker's step times against its own usual times for a step of that image
shape and batch rows (batches of different sizes cost differently), summed over the last
second: a CPU hog or a GC storm on the node, or a throttled or shared GPU, all show there,
steps run continuously while the worker has work of any tier, and the comparison needs no
figure of any other node. The usual time is the mean of a key's first steps, then learnt while
the worker is healthy, so a slowdown that lasts stays visible; it follows a lasting change
slowly (RELEARN_S). With no step for STALE_S there is nothing to judge by: full weight.

Pure: the engine calls `observe` with each step and its clock; `weight_percent` maps a slowdown.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass

# The weight as HAProxy's agent-check takes it: percent of the server's configured weight.
FULL_PCT = 100
# Never 0 (HAProxy's DRAIN: no new traffic): a slow worker still gets its small share, and all
# of them their equal shares when every one is slow. 1 % of the configured `weight 256` is 2 (HAProxy
# rounds down): for a p99 within 1.2x of the fleet's without a fault, under 1 % of turbo may meet
# a slow node (measured: at 1 of 100, one request per fault window, each in the tail).
FLOOR_PCT = 1
# Up to this slowdown (step time over a window / usual step time) a worker is healthy: full
# weight. Above the noise measured on nodes of 0.5 CPU (docs/fleet.md, "Weights": windows of a
# second at 0.84-1.17x for 128 px steps; with a CPU hog in the node's cgroup 1.0-3.2x, mostly
# over 1.5x).
HEALTHY_SLOWDOWN = 1.3
# Beyond it the weight falls as (HEALTHY_SLOWDOWN / slowdown) ** STEEPNESS: 31 % at 1.4x, 10 % at
# 1.5x, the floor from 1.7x. Steep because the fleet's tail is what matters: a node half
# again as slow should get next to none of the turbo, not a share in proportion to its speed.
STEEPNESS = 16
# The slowdown: the steps that ended within the last WINDOW_S against their usual times (a ratio
# of sums, so that one long step - a CPU quota's throttled period, a GC pause - counts for its
# time and no more). A second: a 3x slowdown reads 1.5x half a second in and 3x after a second.
WINDOW_S = 1.0
# The slowdown reported rises with the window's at once and falls towards it with this time
# constant: a node under a fault has spells at its usual pace (measured in the fleet bench's CPU
# hog window, where the agent's cpu_share lever wins the CPU back for a while: 6-9 s), which must
# not let turbo back in; each relapse costs a second of turbo on a slow node before it is seen.
FALL_S = 5.0
# A step key's (image shape, batch rows) first step may trace a graph or warm caches: not counted.
# Its next LEARN_STEPS make its usual time (their mean; until then its steps are not judged,
# and a worker with no key known has full weight); after them it follows each step by
# LEARN of the difference while the worker is healthy, and with the time constant RELEARN_S while
# it is slow, so that a slowdown that lasts that long becomes the new usual pace (a node slower
# for good is judged against itself).
LEARN_STEPS = 100
LEARN = 0.02
RELEARN_S = 600.0
# No step for this long: the slowdown is unknown (an idle worker is a fine choice), full weight.
STALE_S = 10.0


def weight_percent(slowdown: float | None) -> int:
    """HAProxy's weight (percent of the configured one) for a worker whose steps run `slowdown`
    times their usual time (None: unknown)."""
    if slowdown is None or slowdown <= HEALTHY_SLOWDOWN:
        return FULL_PCT
    return max(FLOOR_PCT, round(FULL_PCT * (HEALTHY_SLOWDOWN / slowdown) ** STEEPNESS))


@dataclass
class _Usual:
    """The usual step time of one step key: None until its first step has passed."""

    seconds: float | None = None
    steps: int = 0  # counted into it


class StepPace:
    """The recent slowdown of a worker's steps against its own usual pace, per step key."""

    def __init__(self) -> None:
        self._usual: dict[Hashable, _Usual] = {}
        self._window: collections.deque[tuple[float, float, float]] = collections.deque()  # (end, seconds, usual)
        self._level: float | None = None  # the slowdown reported: the window's, falling slowly
        self._last_at: float | None = None

    def observe(self, key: Hashable, seconds: float, now: float) -> None:
        """One step of `key` (image shape and batch rows) took `seconds`, ending at `now`."""
        dt = 0.0 if self._last_at is None else max(0.0, now - self._last_at)
        if dt > STALE_S:  # after an idle spell: judged afresh
            self._level = None
        self._last_at = now
        usual = self._usual.setdefault(key, _Usual())
        if usual.seconds is None:  # the first step of its kind: tracing, warming
            usual.seconds = 0.0
            return
        if usual.steps < LEARN_STEPS:  # the mean of its first steps, whatever the node's state
            usual.steps += 1
            usual.seconds += (seconds - usual.seconds) / usual.steps
            return  # judged by once known
        self._window.append((now, seconds, usual.seconds))
        while self._window[0][0] < now - WINDOW_S and len(self._window) > 1:
            self._window.popleft()
        expected = sum(u for _, _, u in self._window)
        ratio = sum(s for _, s, _ in self._window) / expected if expected > 0 else 1.0
        if self._level is None or ratio >= self._level:
            self._level = ratio
        else:
            self._level += (ratio - self._level) * min(1.0, dt / FALL_S)
        learn = LEARN if ratio <= HEALTHY_SLOWDOWN else min(1.0, dt / RELEARN_S)
        usual.seconds += learn * (seconds - usual.seconds)

    def slowdown(self, now: float) -> float | None:
        """Step time over usual step time in the window before the last step, falling no faster than
        FALL_S allows; None when unknown (no step for STALE_S, or no step key learnt yet)."""
        if self._last_at is None or now - self._last_at > STALE_S:
            return None
        return self._level

    def describe(self, now: float) -> dict:
        """For the engine's snapshot: the slowdown and the weight it gives."""
        s = self.slowdown(now)
        return {"slowdown": None if s is None else round(s, 3), "weight_percent": weight_percent(s)}
