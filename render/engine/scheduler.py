"""The engine: one thread that owns the model and runs boundary after boundary.

At every denoising-step boundary it asks the pure batching policy (render/batching.py) what
to do next and runs one of diffusers' stages for a batch:

  1. encode prompt   (render/engine/encode_prompt.py)   new jobs' conditioning (every encoder), through the cache
  2. prepare latents (render/engine/prepare_latents.py) a sample's scheduler and noise, at its first step
  3. denoise         (render/engine/denoise.py)         one denoiser call for the composed batch
  4. decode          (render/engine/decode.py)          one VAE call for finished latents

The model family (render/engine/families: SD 1.x/2.x, SDXL, SD3, Flux) says how each stage conditions
and lays out its tensors, and supplies the per-tier steps, sampler and guidance the settings
do not name.

The job table (render/engine/job_table.py) holds the jobs, admission and draining; other threads
(HTTP, control socket) call submit/cancel/get through this facade. An exception in a batch
fails only the jobs in it, with a message that says what happened; the loop goes on.
`run_once` does one boundary synchronously, which is how tests drive the engine step by step.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from render import batching
from render.jobs import JobRequest, JobState
from render.memory_lock import MemoryLock
from render.throttle import ThrottleState
from render.weight import StepPace
from turbonode.config import WorkerConfig
from turbonode.stats import percentile
from turbonode.tiers import PRIORITY_ORDER, PROTECTED_TIER

from .backends.base import DiffusionBackend
from .decode import decode_images
from .denoise import denoise_step, rows
from .encode_prompt import PromptEncoder
from .families.base import Family, FamilyError, TierDefaults
from .heap import HeapTrim
from .job import Job, Sample
from .job_table import RECENT, JobTable
from .prepare_latents import LatentPreparer

log = logging.getLogger(__name__)

_DEFAULTS = WorkerConfig()  # the worker's defaults are the config's: one definition
# Jobs per tier the snapshot's backlog lists: every queued turbo and fast job at the default
# queue limits (32, 64); lower tiers beyond that never run before a turbo or fast job would finish.
BACKLOG_JOBS = 64
# A turbo job within this long keeps batches without turbo to what batching pays for
# (render/batching.py lower_batch_cap): turbo arrives again soon, and waits for the step in progress.
TURBO_ABOUT_S = 10.0


@dataclass
class EngineSettings:
    max_batch: int = _DEFAULTS.max_batch
    # per-tier overrides; the tiers they do not name take the model family's defaults
    steps: dict = field(default_factory=lambda: dict(_DEFAULTS.steps))
    sampler: dict = field(default_factory=lambda: dict(_DEFAULTS.sampler))
    guidance: dict = field(default_factory=lambda: dict(_DEFAULTS.guidance))
    queue_limit: dict = field(default_factory=lambda: dict(_DEFAULTS.queue_limit))
    min_share: float = _DEFAULTS.min_share
    policy: batching.BatchPolicy = batching.BatchPolicy.STEP_PRIORITY
    co_batch_slack: float = batching.CO_BATCH_SLACK
    intra_op_threads: int = 0  # torch threads the engine runs (render/cpu_threads.py); 0: leave torch's

    @classmethod
    def from_config(cls, cfg: WorkerConfig, **overrides: Any) -> EngineSettings:
        base = cls()
        # a partial per-tier table in the file overrides only the tiers it names
        return cls(
            max_batch=cfg.max_batch,
            steps={**base.steps, **cfg.steps},
            sampler={**base.sampler, **cfg.sampler},
            guidance={**base.guidance, **cfg.guidance},
            queue_limit={**base.queue_limit, **cfg.queue_limit},
            min_share=cfg.min_share,
            **overrides,
        )

    def tier_defaults(self, family: Family) -> TierDefaults:
        """The family's per-tier steps, sampler and guidance, with these settings' overrides on top.

        A sampler the family cannot use is refused here, naming the config key."""
        d = family.defaults
        merged = TierDefaults({**d.steps, **self.steps}, {**d.guidance, **self.guidance}, {**d.sampler, **self.sampler})
        for tier, sampler in merged.sampler.items():
            try:
                family.check_sampler(sampler)
            except FamilyError as exc:
                raise FamilyError(f"worker.sampler.{tier}: {exc}") from None
        return merged


class Engine:
    def __init__(
        self,
        backend: DiffusionBackend,
        encoder: PromptEncoder,
        family: Family,
        settings: EngineSettings | None = None,
        *,
        throttle: ThrottleState | None = None,
        metrics: Any = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_event: Callable[[dict], None] | None = None,
    ):
        self.backend = backend
        self.encoder = encoder
        self.family = family
        self.prepare = LatentPreparer(family, backend.device)
        # sizes must survive the VAE's and the denoiser's downsampling (or patching) without remainders
        self.size_multiple = family.size_multiple
        self.settings = settings or EngineSettings()
        self.defaults = self.settings.tier_defaults(family)  # per tier: steps, sampler, guidance
        self.throttle = throttle or ThrottleState(clock=clock, wall=wall)
        self.clock, self.wall = clock, wall
        self.on_event = on_event
        self.jobs = JobTable(
            self.settings.queue_limit, self.throttle, self._pace, clock=clock, wall=wall, metrics=metrics
        )
        self._credits: dict[str, float] = {}
        self._decode_deferred = 0
        self._turbo_seen = -math.inf  # when a boundary last had a turbo job live
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.step_times: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.decode_s_per_image: float | None = None
        self.step_cost: dict[tuple, float] = {}  # (shape, denoiser rows) -> smoothed step seconds
        self.speed = StepPace()  # against its usual pace: the weight a balancer reads (render/weight.py)
        self.steps_total = 0
        self.intra_op_threads = 0  # what the engine thread last set (0: not set yet)
        self.memory_lock = MemoryLock("engine")  # its pages resident while the throttle asks
        self.heap_trim = HeapTrim(self.clock)
        self.heartbeat = clock()
        self.pid = os.getpid()  # the process the engine runs in (render/front/remote_engine.py: another one)

    @property
    def metrics(self) -> Any:
        return self.jobs.metrics

    @metrics.setter
    def metrics(self, value: Any) -> None:
        self.jobs.metrics = value

    # ---- limits -----------------------------------------------------------------------

    def limits(self) -> batching.Limits:
        t = self.throttle.current()
        max_batch = self.settings.max_batch
        if t is not None and t.max_batch is not None:
            max_batch = min(max_batch, t.max_batch)
        # while draining, paused work runs too: shutdown must not wait on a throttle
        paused = t.paused_tiers if t is not None and self.jobs.accepting else frozenset()
        return batching.Limits(
            max_batch,
            paused,
            self.settings.min_share,
            dict(self.step_cost),
            self.settings.co_batch_slack,
            turbo_max_batch=self.settings.max_batch,  # turbo's own batch is never throttled
            turbo_about=self.clock() - self._turbo_seen < TURBO_ABOUT_S,
        )

    def threads_wanted(self) -> int:
        """The configured threads, or fewer while a throttle asks for fewer (never more)."""
        base = self.settings.intra_op_threads
        t = self.throttle.current()
        if t is None or t.intra_op_threads is None or not base:
            return base
        return min(base, t.intra_op_threads)

    def _apply_threads(self) -> None:
        want = self.threads_wanted()
        if want and want != self.intra_op_threads:
            # OpenMP's thread count is per calling thread: set it in the thread that runs the stages
            torch.set_num_threads(want)
            if self.intra_op_threads:
                log.info("intra-op threads %d -> %d", self.intra_op_threads, want)
            self.intra_op_threads = want

    def steps_for(self, tier: str, requested: int) -> int:
        t = self.throttle.current()
        cap = t.step_caps.get(tier) if t else None
        return min(requested, cap) if cap else requested

    def _pace(self) -> tuple[float | None, int]:
        return percentile(self.step_times, 50), self.limits().max_batch

    # ---- the job table, for the HTTP API and the control socket ----------------------

    def submit(self, request: JobRequest) -> Job:
        """Queue a job; raises Draining, TierShed or QueueFull (all Rejected) when it cannot."""
        return self.jobs.submit(request)

    async def enqueue(self, request: JobRequest, keep_images: bool = True, answer_on=None) -> Job:
        """`submit`, as the HTTP API awaits it (the engine process's handle queues over a pipe);
        the pixels stay until the API drops them (`keep_images` and `answer_on`, the client's
        connection, matter only across the pipe: in one process the API answers)."""
        return self.submit(request)

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job; a queued one leaves the queue at once, a running one at the next boundary."""
        return self.jobs.cancel(job_id)

    def close_intake(self) -> tuple[int, int]:
        return self.jobs.close_intake()

    def wait_idle(self, timeout: float) -> bool:
        return self.jobs.wait_idle(timeout)

    def fail_all(self, message: str) -> int:
        return self.jobs.fail_all(message)

    @property
    def accepting(self) -> bool:
        return self.jobs.accepting

    # ---- the stages, each failing only its own batch ----------------------------------

    @staticmethod
    def _describe_error(what: str, n: int, exc: BaseException) -> str:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return f"out of memory during {what} of a batch of {n} images; retry, or lower n or size"
        return f"{what} of a batch of {n} images failed: {type(exc).__name__}: {exc}"

    def _after_oom(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _emit(self, kind: str, samples: list[Sample], seconds: float) -> None:
        if self.on_event is not None:
            self.on_event(
                {
                    "kind": kind,
                    "samples": [(s.job.id, s.job.tier, s.index, s.step) for s in samples],
                    "seconds": seconds,
                    "at": self.clock(),
                }
            )

    def _encode(self, jobs: list[Job]) -> None:
        try:
            self.encoder.encode_jobs(jobs)
        except Exception as exc:  # noqa: BLE001 - fail the job that caused it, keep serving
            why = f"{type(exc).__name__}: {exc}"
            if len(jobs) > 1:  # one job's prompt fails the whole call: find it, job by job
                log.warning("text encoding of %d jobs failed (%s); encoding them one by one", len(jobs), why)
                for job in jobs:
                    self._encode([job])
                return
            log.exception("text encoding of job %s failed", jobs[0].id)
            self.jobs.fail(jobs, f"text encoding failed: {why}")

    def _step(self, samples: list[Sample]) -> None:
        t0 = self.clock()
        try:
            for s in samples:
                if s.state is None:
                    job = s.job
                    self.prepare(s, self.defaults.sampler[job.tier], self.steps_for(job.tier, job.request.steps))
            weights = [rows(self.family, s) for s in samples]
            n_rows = denoise_step(self.family, self.backend, samples)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the worker
            log.exception("denoising step failed")
            self._after_oom()
            self.jobs.fail({s.job for s in samples}, self._describe_error("a denoising step", len(samples), exc))
            return
        seconds = self.clock() - t0
        _charge(samples, seconds, weights)
        key = (_shape(samples[0]), n_rows)
        self.step_cost[key] = _smooth(self.step_cost.get(key), seconds)
        self.speed.observe(key, seconds, t0 + seconds)
        self.step_times.append(seconds)
        self.steps_total += 1
        if self.metrics is not None:
            self.metrics.observe_step(seconds, [s.job.tier for s in samples])
        now = self.clock()
        with self.jobs.lock:
            for s in samples:
                job = s.job
                if job.state is JobState.RUNNING and all(x.denoised for x in job.samples):
                    job.state, job.denoised = JobState.DECODING, now
                    if self.metrics is not None and job.started is not None:
                        self.metrics.observe_stage(job.tier, "denoise", now - job.started)
        self._emit("step", samples, seconds)

    def _decode(self, samples: list[Sample]) -> None:
        t0 = self.clock()
        try:
            arrays = decode_images(self.family, self.backend, samples)
        except Exception as exc:  # noqa: BLE001
            log.exception("VAE decode failed")
            self._after_oom()
            self.jobs.fail({s.job for s in samples}, self._describe_error("decoding", len(samples), exc))
            return
        seconds = self.clock() - t0
        _charge(samples, seconds, [1] * len(samples))
        self.decode_s_per_image = _smooth(self.decode_s_per_image, seconds / len(samples))
        if self.metrics is not None:
            self.metrics.observe_decode(seconds)
        with self.jobs.lock:
            for s, arr in zip(samples, arrays):
                s.image = arr
                if s.state is not None:
                    s.state.release()
            for job in dict.fromkeys(s.job for s in samples):  # in batch order: oldest first
                if all(x.image is not None for x in job.samples):
                    self.jobs.finish(job, JobState.DONE)
        self._emit("decode", samples, seconds)

    # ---- one boundary -----------------------------------------------------------------

    def run_once(self) -> bool:
        """One step boundary; True when it did some work."""
        self.heartbeat = self.clock()
        self._apply_threads()
        with self.jobs.lock:
            limits = self.limits()
            live = [j for j in self.jobs.live() if j.tier not in limits.paused]
        if any(j.tier == PROTECTED_TIER for j in live):
            self._turbo_seen = self.clock()
        to_encode = [j for j in live if j.cond is None]
        if to_encode:
            self._encode(to_encode)
        live = [j for j in live if j.cond is not None and not j.state.terminal]
        runnable, finished = [], []
        for job in live:
            for s in job.samples:
                if s.image is not None:
                    continue
                if s.denoised:
                    finished.append(s)
                else:
                    runnable.append(s)
        if not runnable and not finished:
            return bool(to_encode)
        by_key: dict[Hashable, Sample] = {s.key: s for s in (*runnable, *finished)}
        plan = batching.plan_boundary(
            [self._candidate(s) for s in runnable],
            [batching.Finished(s.key, s.job.tier, _shape(s), s.job.seq) for s in finished],
            limits,
            self._credits,
            self._decode_deferred,
            self.settings.policy,
            percentile(self.step_times, 50),
            self.decode_s_per_image,
        )
        self._decode_deferred = plan.deferred
        if plan.decode:
            self._decode([by_key[k] for k in plan.decode])
            return True
        assert plan.step is not None
        self._credits = plan.step.credits
        if not plan.step.keys:
            return False
        batch = [by_key[k] for k in plan.step.keys]
        self.jobs.mark_running(dict.fromkeys(s.job for s in batch), self.clock())
        self._step(batch)
        return True

    def _candidate(self, s: Sample) -> batching.Candidate:
        return batching.Candidate(
            s.key, s.job.tier, _shape(s), s.job.seq, s.started, rows(self.family, s), self._steps_left(s) == 1
        )

    def _steps_left(self, s: Sample) -> int:
        """Denoising steps `s` has still to take (a step cap applies from its first step)."""
        return s.total_steps - s.step if s.started else self.steps_for(s.job.tier, s.job.request.steps)

    # ---- the thread -------------------------------------------------------------------

    def run(self) -> None:
        wake = self.jobs.wake
        while True:
            t = self.throttle.current()
            self.memory_lock.apply(t is not None and t.lock_memory)
            self.heap_trim.maybe()
            with wake:
                if self._stopping:
                    return
                if not self.jobs.has_work(self.limits().paused):
                    # wake at least every second (heartbeat) and when the throttle expires
                    t = self.throttle.current()
                    wake.wait(timeout=min(1.0, t.expires_at - self.clock()) if t else 1.0)
                    self.heartbeat = self.clock()
                    continue
            try:
                did = self.run_once()
            except Exception:  # noqa: BLE001 - a bug in one boundary must not kill the worker
                log.exception("engine boundary failed")
                did = False
            if not did:
                with wake:
                    wake.wait(timeout=0.05)

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self.run, name="turbonode-engine", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Re-plan now (the throttle changed)."""
        with self.jobs.wake:
            self.jobs.wake.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        with self.jobs.wake:
            self._stopping = True
            self.jobs.wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- status -----------------------------------------------------------------------

    def describe_model(self) -> dict:
        """What the worker serves: the model, its family, and the per-tier defaults in force."""
        d = self.defaults
        return {
            **self.family.describe(),
            "size_multiple": self.size_multiple,
            "defaults": {"steps": dict(d.steps), "guidance": dict(d.guidance), "sampler": dict(d.sampler)},
        }

    def snapshot(self) -> dict:
        """What status and the metrics read, in one piece (one call to an engine in its own process)."""
        tiers = self.jobs.tiers(self.clock())
        steps = list(self.step_times)
        enc, device = self.encoder, self.backend.device
        return {
            "tiers": tiers,
            "step_time_s": {
                "last": steps[-1] if steps else None,
                "p50": percentile(steps, 50),
                "p99": percentile(steps, 99),
            },
            "max_batch": self.limits().max_batch,
            "intra_op_threads": {"current": self.intra_op_threads, "configured": self.settings.intra_op_threads},
            "memory_lock": self.memory_lock.status(),
            "steps_total": self.steps_total,
            "accepting": self.jobs.accepting,
            "text_cache": {"entries": len(enc), "hits": enc.hits, "misses": enc.misses, "hit_ratio": enc.hit_ratio},
            "gpu_allocated_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
            "pace": self.pace(),
            "backlog": self.backlog(),
            "speed": self.speed.describe(self.clock()),
        }

    def pace(self) -> dict:
        """What the engine measured, as render/front/admission.py predicts from it: smoothed step seconds
        per image shape and denoiser rows, decode seconds per image, and the batching limits."""
        limits = self.limits()
        return {
            "step_cost": [[h, w, n_rows, round(s, 6)] for ((h, w), n_rows), s in self.step_cost.items()],
            "decode_s_per_image": self.decode_s_per_image,
            "step_p50_s": percentile(self.step_times, 50),
            "max_batch": limits.max_batch,
            "turbo_max_batch": limits.turbo_max_batch,
            "min_share": limits.min_share,
            "co_batch_slack": limits.co_batch_slack,
            "turbo_about": limits.turbo_about,
            "paused": sorted(limits.paused),
            "uses_cfg": self.family.uses_cfg,
            "credits": dict(self._credits),  # the min-share state the next boundary starts from
            "decode_deferred": self._decode_deferred,
        }

    def backlog(self) -> list[list]:
        """Each live job's images not yet decoded, in arrival order, as render/front/admission.py replays
        them: [tier, seq, height, width, rows, steps left, started, images]; at most BACKLOG_JOBS
        jobs of each tier (more never finish within an objective's horizon)."""
        out, per_tier = [], dict.fromkeys(PRIORITY_ORDER, 0)
        with self.jobs.lock:
            for job in self.jobs.pending():
                if job.state.terminal or per_tier[job.tier] >= BACKLOG_JOBS:
                    continue
                per_tier[job.tier] += 1
                groups: dict[int, list[Sample]] = {}  # a job's images by steps left (most share one)
                for s in job.samples:
                    if s.image is None:
                        groups.setdefault(self._steps_left(s), []).append(s)
                for left, group in groups.items():
                    h, w = _shape(group[0])
                    out.append(
                        [job.tier, job.seq, h, w, rows(self.family, group[0]), left, group[0].started, len(group)]
                    )
        return out


def _charge(samples: list[Sample], seconds: float, weights: list[int]) -> None:
    """Each sample's job pays its share of one batched call: by denoiser rows (an image with
    classifier-free guidance takes two), one image each for a decode. Not wall time: a job that
    waits, or shares a batch, pays for what the engine computed for it."""
    total = sum(weights)
    for s, w in zip(samples, weights):
        s.job.engine_s += seconds * w / total


def _shape(s: Sample) -> tuple[int, int]:
    return (s.job.request.height, s.job.request.width)


def _smooth(old: float | None, new: float) -> float:
    """Exponential moving average that starts at the first value."""
    return new if old is None else 0.8 * old + 0.2 * new
