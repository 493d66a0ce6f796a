"""Deadline-aware admission: would a new job of a tier finish within the tier's objective?

A worker that cannot meet a tier's objective (worker.slo) should say so at once rather than
queue the job to miss it: GET /readyz?tier=T answers 503 while a new job of the tier would miss,
and with worker.refuse_unready the request itself gets 503 + Retry-After, so a balancer sends it
to another node (render/front/readiness.py, render/front/http_api.py).

The prediction replays the engine's own boundary policy (render/batching.py plan_boundary) over
what the engine reports in its snapshot (render/engine/scheduler.py `pace` and `backlog`): every image not
yet decoded, with its tier, place in the queue, shape, denoiser rows and steps left, plus the
new job at the end of its tier. Each replayed step costs what the engine measured for that image
shape and batch rows (smoothed, per model family since a worker serves one; between measured
batch sizes interpolated by batching.estimate_cost), each decode its images' measured seconds,
and the boundary in progress when the job arrives one median step. Lower tiers take part as
they do in the engine: a step at a time at most, and their min_share batches.

Pure: nothing here reads a clock or asks the engine; the caller passes the snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from render import batching
from turbonode.tiers import PROTECTED_TIER

MAX_BOUNDARIES = 10_000  # a replay ends here whatever it predicts (the objective ends it far sooner)
# Images of each lower tier in the replay, in batches: they fill what a batch leaves over and
# take their min_share of the steps, which a few batches' worth does as well as a full queue.
LOWER_IMAGES = 4


@dataclass(frozen=True)
class NewJob:
    tier: str
    steps: int
    n: int
    height: int
    width: int
    guidance: float


@dataclass(frozen=True)
class Prediction:
    seconds: float  # from now until the job's last image is decoded (at least: a replay stops past `limit_s`)
    ahead: int  # images of its own or a higher tier queued or running before it

    def misses(self, objective_s: float) -> bool:
        """Over the objective with work ahead. A job with nothing ahead of it is admitted whatever
        the measured pace says: the node cannot serve it sooner later, and only the steps it runs
        renew a pace measured during a passing stall."""
        return self.ahead > 0 and self.seconds > objective_s

    def retry_after(self, objective_s: float) -> float:
        """Seconds until the work ahead has shrunk enough for such a job to fit, at the measured pace."""
        return max(1.0, math.ceil(self.seconds - objective_s))


def rows_for(uses_cfg: bool, guidance: float) -> int:
    """Denoiser rows per image: two with classifier-free guidance (render/engine/families/base.py cfg_for)."""
    return 2 if uses_cfg and guidance > 1.0 else 1


def predict(snapshot: Mapping, job: NewJob, limit_s: float) -> Prediction | None:
    """When `job`, submitted now, would finish, from an engine snapshot; None while the engine has
    measured no step of the job's image shape (then nothing is refused: the first steps measure it).
    The replay stops once past `limit_s`: the answer is then only "later than that"."""
    pace = snapshot["pace"]
    shape = (job.height, job.width)
    table: dict[tuple[int, int], dict[int, float]] = {}
    for h, w, n_rows, seconds in pace["step_cost"]:
        table.setdefault((h, w), {})[n_rows] = seconds
    if shape not in table:
        return None
    limits = batching.Limits(
        pace["max_batch"],
        frozenset(pace["paused"]),
        pace["min_share"],
        {((h, w), n_rows): s for h, w, n_rows, s in pace["step_cost"]},
        pace["co_batch_slack"],
        turbo_max_batch=pace["turbo_max_batch"],
        turbo_about=pace["turbo_about"] or job.tier == PROTECTED_TIER,
    )
    rank = batching.RANK[job.tier]
    samples: dict[Hashable, _Image] = {}
    lower: dict[str, int] = {}  # images of each lower tier in the replay
    last_seq = -1
    for tier, seq, h, w, n_rows, steps, started, count in snapshot["backlog"]:
        last_seq = max(last_seq, seq)
        if tier in limits.paused:
            continue
        if batching.RANK[tier] > rank:  # they only fill batches and take their min_share: a few do that
            count = min(count, LOWER_IMAGES * limits.max_batch - lower.get(tier, 0))
            lower[tier] = lower.get(tier, 0) + count
        for i in range(count):
            samples[(seq, steps, i)] = _Image(tier, seq, (h, w), n_rows, steps, started)
    ahead = sum(1 for s in samples.values() if batching.RANK[s.tier] <= rank)
    busy = bool(samples)
    mine: set[Hashable] = {("new", i) for i in range(job.n)}
    for key in mine:
        samples[key] = _Image(job.tier, last_seq + 1, shape, rows_for(pace["uses_cfg"], job.guidance), job.steps, False)
    decode_s = pace["decode_s_per_image"] or 0.0
    seconds = (pace["step_p50_s"] or 0.0) if busy else 0.0  # the boundary in progress
    credits: dict[str, float] = dict(pace["credits"])
    deferred: int = pace["decode_deferred"]
    for _ in range(MAX_BOUNDARIES):
        if not mine & samples.keys() or seconds > limit_s:
            break
        plan = batching.plan_boundary(
            [s.candidate(k) for k, s in samples.items() if s.steps],
            [s.finished(k) for k, s in samples.items() if not s.steps],
            limits,
            credits,
            deferred,
            batching.BatchPolicy.STEP_PRIORITY,
            pace["step_p50_s"],
            decode_s,
        )
        deferred = plan.deferred
        if plan.decode:
            seconds += decode_s * len(plan.decode)
            for done in plan.decode:
                del samples[done]
            continue
        assert plan.step is not None
        credits = plan.step.credits
        if not plan.step.keys:
            break
        batch = [samples[k] for k in plan.step.keys]
        cost = batching.estimate_cost(sum(s.rows for s in batch), table.get(batch[0].shape, {}))
        seconds += cost or 0.0
        for s in batch:
            s.steps -= 1
            s.started = True
    return Prediction(seconds, ahead)


@dataclass
class _Image:
    """One image in the replay."""

    tier: str
    seq: int
    shape: tuple[int, int]
    rows: int
    steps: int  # left to denoise; 0: waiting for its decode
    started: bool

    def candidate(self, key: Hashable) -> batching.Candidate:
        return batching.Candidate(key, self.tier, self.shape, self.seq, self.started, self.rows, self.steps == 1)

    def finished(self, key: Hashable) -> batching.Finished:
        return batching.Finished(key, self.tier, self.shape, self.seq)
