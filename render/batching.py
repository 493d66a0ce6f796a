"""Scheduling policy as pure functions: which samples step next, and when to decode.

The engine calls these at every denoising-step boundary with plain values (no tensors, no
clocks), so the policy is testable on its own. A *candidate* is one image of one job that
is ready for its next UNet step. Three policies share the engine so benchmarks compare
like with like:

- STEP_PRIORITY (the worker's): the batch is composed anew at every step, highest tier
  first, so a turbo job that arrives while relax jobs denoise waits at most one step.
  Lower-tier samples ride along with turbo only while the measured step cost says they
  are nearly free (a GPU with headroom: yes; a saturated CPU: no), so they never slow
  turbo's own steps. Waiting lower tiers earn credit toward a minimum share of batch
  slots, paid out as whole batches of their own (no starvation).
- JOB_FIFO: whole-job, no preemption: a started job stays in the batch until done; free
  slots go to the oldest waiting job of any tier (what webui queues do).
- JOB_PRIORITY: whole-job, no preemption, free slots go to the highest tier first (what
  priority levels in a request queue do).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turbonode.tiers import PRIORITY_ORDER, PROTECTED_TIER

RANK: dict[str, int] = {t: i for i, t in enumerate(PRIORITY_ORDER)}
Shape = tuple[int, ...]  # (height, width): samples of one shape batch together


class BatchPolicy(str, enum.Enum):
    STEP_PRIORITY = "step_priority"
    JOB_FIFO = "job_fifo"
    JOB_PRIORITY = "job_priority"


CO_BATCH_SLACK = 0.25  # lower tiers join turbo while its step gets at most this much slower


@dataclass(frozen=True)
class Candidate:
    key: Hashable  # identifies the sample, e.g. (job_id, index)
    tier: str
    shape: Shape  # samples batch together only when shapes match
    seq: int  # arrival order of the job (FIFO within a tier)
    started: bool = False  # has taken at least one step
    rows: int = 1  # UNet rows: 2 with classifier-free guidance
    last_step: bool = False  # its next step is its last: then it waits for its decode


@dataclass(frozen=True)
class Limits:
    max_batch: int
    paused: frozenset[str] = frozenset()
    min_share: float = 0.0
    step_cost: Mapping[tuple[Shape, int], float] = field(default_factory=dict)  # (shape, UNet rows) -> seconds
    co_batch_slack: float = CO_BATCH_SLACK
    # Turbo's own samples batch up to this (the configured max_batch) even when a throttle lowers
    # max_batch: the throttle holds back lower tiers, never turbo (its backlog under a GC storm
    # or a CPU hog drains only by batching); None: max_batch.
    turbo_max_batch: int | None = None
    # The engine saw a turbo job lately: a turbo job that arrives waits for the step in progress,
    # so a batch without turbo then holds only as many samples as batching pays for (lower_batch_cap).
    turbo_about: bool = False

    def costs_of(self, shape: Shape) -> dict[int, float]:
        """The measured step seconds of `shape`, by UNet rows (estimate_cost's table)."""
        return {rows: t for (s, rows), t in self.step_cost.items() if s == shape}


def estimate_cost(rows: int, table: Mapping[int, float]) -> float | None:
    """Step time for `rows` UNet rows from measured points; None when nothing is known.

    Between two measured points: linear interpolation. Outside them: proportional to the
    rows (the compute-bound case), which keeps turbo alone until its own cost is measured.
    """
    if rows in table:
        return table[rows]
    below = [r for r in table if r < rows]
    above = [r for r in table if r > rows]
    if below and above:
        lo, hi = max(below), min(above)
        return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
    nearest = max(below) if below else min(above, default=None)
    return None if nearest is None else table[nearest] * rows / nearest


@dataclass(frozen=True)
class Composition:
    keys: tuple[Hashable, ...]  # the samples to step, in batch order
    credits: dict[str, float] = field(default_factory=dict)


def _priority_key(c: Candidate) -> tuple[int, int, str]:
    return (RANK[c.tier], c.seq, str(c.key))


def _fifo_key(c: Candidate) -> tuple[int, str]:
    return (c.seq, str(c.key))


def _fill(
    ordered: list[Candidate],
    chosen: list[Candidate],
    shape: Shape,
    capacity: int,
    admit: Callable[[Candidate, list[Candidate]], bool] | None = None,
) -> None:
    taken = {c.key for c in chosen}
    for c in ordered:
        if len(chosen) >= capacity:
            return
        if c.shape == shape and c.key not in taken and (admit is None or admit(c, chosen)):
            chosen.append(c)
            taken.add(c.key)


def _cheap_for_turbo(limits: Limits) -> Callable[[Candidate, list[Candidate]], bool]:
    """admit(): a lower-tier sample joins a turbo batch only if turbo's step stays nearly as fast."""

    def admit(c: Candidate, chosen: list[Candidate]) -> bool:
        if c.tier == PROTECTED_TIER:
            return True
        turbo_rows = sum(x.rows for x in chosen if x.tier == PROTECTED_TIER)
        if not turbo_rows:
            return True
        table = limits.costs_of(c.shape)
        alone = estimate_cost(turbo_rows, table)
        joined = estimate_cost(sum(x.rows for x in chosen) + c.rows, table)
        if alone is None or joined is None:
            return True  # nothing measured yet: batch, and learn the cost
        return joined <= alone * (1 + limits.co_batch_slack)

    return admit


def lower_batch_cap(chosen: Sequence[Candidate], capacity: int, limits: Limits) -> int:
    """How many of `chosen` (a batch without turbo, in order) to step while turbo is about: the
    fewest whose cost per sample is within co_batch_slack of a full batch's, at least one.

    Where batching is nearly free (a GPU with headroom) that is close to a full batch; on a
    saturated CPU, where a step's cost grows with its rows, a few samples: turbo's wait for the
    step in progress shrinks with it, and the lower tiers give up at most co_batch_slack of their
    throughput, as turbo gives up at most that much of its step time to let them ride along."""
    table = limits.costs_of(chosen[0].shape)
    rows = [c.rows for c in chosen]
    full = estimate_cost(round(sum(rows) * capacity / len(rows)), table)
    if full is None:
        return len(chosen)  # nothing measured yet: batch, and learn the cost
    allowed = full / capacity * (1 + limits.co_batch_slack)
    for n in range(1, len(chosen)):
        cost = estimate_cost(sum(rows[:n]), table)
        if cost is not None and cost / n <= allowed:
            return n
    return len(chosen)


def _whole_job(cands: list[Candidate], limits: Limits, order: Callable[[Candidate], tuple[Any, ...]]) -> Composition:
    running = sorted((c for c in cands if c.started), key=order)
    waiting = sorted((c for c in cands if not c.started), key=order)
    if not running and not waiting:
        return Composition(())
    shape = (running or waiting)[0].shape
    # Started samples are never preempted, even when the throttle lowers max_batch below
    # their number: stopping them would hold their memory without making progress.
    chosen = list(running)
    _fill(waiting, chosen, shape, max(limits.max_batch, len(running)))
    return Composition(tuple(c.key for c in chosen))


def _step_priority(cands: list[Candidate], limits: Limits, credits: dict[str, float]) -> Composition:
    ordered = sorted(cands, key=_priority_key)
    if not ordered:
        return Composition((), {})
    capacity = limits.max_batch
    waiting_tiers = {c.tier for c in ordered}
    # Tiers below the best waiting one earn min_share of the slots per batch as credit while
    # some of their samples are left waiting; a full batch of credit buys a batch of their
    # own. Credit is capped at one batch and lost once the tier has nothing left waiting.
    best = ordered[0].tier
    credits = {t: v for t, v in credits.items() if t in waiting_tiers and t != best}
    # starved: this batch's earning completes a batch of credit
    starved = [t for t in PRIORITY_ORDER if credits.get(t, 0.0) + limits.min_share * capacity >= capacity - 1e-9]
    if starved:
        # A whole batch of the starved tier: it costs a turbo job at most one step's wait,
        # where a slot inside every turbo batch would slow each of turbo's steps instead.
        own = [c for c in ordered if c.tier == starved[0]]
        chosen = [own[0]]
        _fill(own, chosen, own[0].shape, capacity)
    else:
        chosen = [ordered[0]]
        if chosen[0].tier == PROTECTED_TIER:  # turbo first, up to its own cap; the others within max_batch
            turbo = [c for c in ordered if c.tier == PROTECTED_TIER]
            _fill(turbo, chosen, chosen[0].shape, max(capacity, limits.turbo_max_batch or capacity))
        _fill(ordered, chosen, ordered[0].shape, capacity, _cheap_for_turbo(limits))
    if limits.turbo_about and chosen[0].tier != PROTECTED_TIER:
        chosen = chosen[: lower_batch_cap(chosen, capacity, limits)]
    granted = {t: sum(c.tier == t for c in chosen) for t in waiting_tiers}
    left_waiting = {t for t in waiting_tiers if granted[t] < sum(c.tier == t for c in ordered)}
    new_credits = {}
    for t in left_waiting:
        if RANK[t] <= RANK[best]:
            continue
        earned = credits.get(t, 0.0) + limits.min_share * capacity - granted[t]
        new_credits[t] = min(float(capacity), max(0.0, earned))
    return Composition(tuple(c.key for c in chosen), new_credits)


def compose_batch(
    candidates: Iterable[Candidate],
    limits: Limits,
    credits: dict[str, float] | None = None,
    policy: BatchPolicy = BatchPolicy.STEP_PRIORITY,
) -> Composition:
    """The samples to run in the next UNet call (all of one shape, at most max_batch).

    Candidates of paused tiers are left out (they keep their state and wait). `credits`
    is the min-share state the previous call returned; pass it back unchanged.
    """
    cands = [c for c in candidates if c.tier not in limits.paused]
    if policy is BatchPolicy.JOB_FIFO:
        return _whole_job(cands, limits, _fifo_key)
    if policy is BatchPolicy.JOB_PRIORITY:
        return _whole_job(cands, limits, _priority_key)
    return _step_priority(cands, limits, credits or {})


# ---- decoding ------------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    key: Hashable
    tier: str
    shape: Shape
    seq: int


def should_decode(
    finished_tiers: Iterable[str], runnable_tiers: Iterable[str], deferred: int, min_share: float
) -> bool:
    """Decode now, or take another step first?

    Finished latents of a tier at least as high as every runnable one decode at once.
    Otherwise a step of the higher tier goes first; after 1/min_share deferrals the decode
    goes anyway, so a flood of turbo steps never parks finished relax images forever.
    """
    finished = [RANK[t] for t in finished_tiers]
    if not finished:
        return False
    runnable = [RANK[t] for t in runnable_tiers]
    if not runnable or min(finished) <= min(runnable):
        return True
    return decode_overdue(deferred, min_share)


def decode_overdue(deferred: int, min_share: float) -> bool:
    """Finished images of a lower tier have waited 1/min_share boundaries: their decode goes next."""
    return min_share > 0 and deferred + 1 >= math.ceil(1 / min_share)


def decode_chunk(
    finished: Iterable[Finished],
    max_batch: int,
    step_budget_s: float | None,
    decode_s_per_image: float | None,
    turbo_max_batch: int | None = None,
    oldest_first: bool = False,
) -> tuple[Hashable, ...]:
    """Keys of the next decode batch: best tier first (`oldest_first`: the oldest job's
    images, for an overdue decode), one shape, at most max_batch (turbo's images: at most
    turbo_max_batch, as in compose_batch).

    A decode cannot be interrupted, so below the top tier a chunk is kept to about one
    step's time (a turbo job that arrives meanwhile then waits no longer than a step).
    """
    if oldest_first:
        ordered = sorted(finished, key=lambda f: (f.seq, str(f.key)))
    else:
        ordered = sorted(finished, key=lambda f: (RANK[f.tier], f.seq, str(f.key)))
    if not ordered:
        return ()
    head = ordered[0]
    limit = max_batch
    if head.tier == PROTECTED_TIER:  # turbo's decode is not slowed by lower tiers' images
        ordered = [f for f in ordered if f.tier == PROTECTED_TIER]
        limit = max(max_batch, turbo_max_batch or max_batch)
    elif step_budget_s and decode_s_per_image:
        limit = max(1, min(max_batch, int(step_budget_s / decode_s_per_image)))
    same = [f for f in ordered if f.shape == head.shape]
    return tuple(f.key for f in same[:limit])


# ---- one boundary ------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """What one boundary does: decode the images `decode` names, else the step `step`; and how
    many boundaries finished images will then have waited for their decode (`deferred`)."""

    decode: tuple[Hashable, ...] = ()
    step: Composition | None = None
    deferred: int = 0


def plan_boundary(
    runnable: Sequence[Candidate],
    finished: Sequence[Finished],
    limits: Limits,
    credits: dict[str, float],
    deferred: int,
    policy: BatchPolicy,
    step_budget_s: float | None,
    decode_s_per_image: float | None,
) -> Boundary:
    """The engine's next boundary (render/engine/scheduler.py runs it; render/front/admission.py replays it to
    predict when a new job would finish): a decode when should_decode says so, else a step.

    `deferred` counts the boundaries finished images have waited, whatever ran meanwhile: a
    higher tier's decode does not serve them, so it does not restart the count (a closed-loop
    turbo client would otherwise park relax images for as long as it runs).

    A turbo decode smaller than turbo's batch waits for a step that finishes more turbo images of
    its shape, and then decodes them with it: one VAE call for two images costs far less than two
    (the tiny model on one CPU thread: 74 ms for one image, 103 for two), and under Poisson
    arrivals turbo jobs finish a step apart, so decoding each at once halves nothing and spends
    the node's capacity. It waits only while each such step adds an image, so at most a batch's
    worth of steps."""
    if not should_decode([f.tier for f in finished], [c.tier for c in runnable], deferred, limits.min_share):
        return Boundary(step=compose_batch(runnable, limits, credits, policy), deferred=deferred + bool(finished))
    overdue = decode_overdue(deferred, limits.min_share)
    keys = decode_chunk(
        finished, limits.max_batch, step_budget_s, decode_s_per_image, limits.turbo_max_batch, oldest_first=overdue
    )
    if not overdue:
        step = _step_finishing_with(keys, finished, runnable, limits, credits, policy)
        if step is not None:
            return Boundary(step=step, deferred=deferred + 1)
    left = len(keys) < len(finished)
    return Boundary(decode=keys, deferred=deferred + 1 if left and not overdue else 0)


def _step_finishing_with(
    keys: tuple[Hashable, ...],
    finished: Sequence[Finished],
    runnable: Sequence[Candidate],
    limits: Limits,
    credits: dict[str, float],
    policy: BatchPolicy,
) -> Composition | None:
    """The step to run before the turbo decode of `keys`, when that step finishes another turbo
    image of their shape and the decode has room for it; None: decode now."""
    head = next(f for f in finished if f.key == keys[0])
    if head.tier != PROTECTED_TIER or len(keys) >= max(limits.max_batch, limits.turbo_max_batch or 0):
        return None
    step = compose_batch(runnable, limits, credits, policy)
    chosen = set(step.keys)
    joins = any(
        c.key in chosen and c.last_step and c.tier == PROTECTED_TIER and c.shape == head.shape for c in runnable
    )
    return step if joins else None
