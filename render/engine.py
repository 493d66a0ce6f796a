"""The engine: one thread that owns the model and runs step after step.

At every denoising-step boundary it admits new jobs (text embeddings through the cache),
drops cancelled ones, asks the pure policy (render.batching) what to do next, and runs
either one UNet call for the composed batch (each sample's own scheduler then steps its
slice) or one VAE decode of finished latents. An exception in a batch fails only the jobs
in it, with a message that says what happened; the loop goes on.

Other threads (HTTP, control socket) call submit/cancel/snapshot; a lock guards the job
tables and a condition wakes the loop. `run_once` does one boundary synchronously, which
is how tests drive the engine step by step.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from turbonode.stats import percentile
from turbonode.tiers import PRIORITY_ORDER

from . import batching
from .jobs import (Draining, Job, JobCancelled, JobFailed, JobRequest, JobState, QueueFull, Sample,
                   TierShed)
from .samplers import make_scheduler
from .throttle import ThrottleState

log = logging.getLogger(__name__)

RECENT = 512          # samples kept for p50/p99 figures
KEEP_FINISHED = 1024  # terminal jobs kept for GET /v1/jobs/{id}


@dataclass
class EngineSettings:
    max_batch: int = 4
    steps: dict = field(default_factory=lambda: {"turbo": 4, "fast": 12, "other": 20, "relax": 25})
    sampler: dict = field(default_factory=lambda: {"turbo": "euler_a", "fast": "dpmpp_2m",
                                                   "other": "dpmpp_2m", "relax": "dpmpp_2m"})
    guidance: dict = field(default_factory=lambda: {"turbo": 0.0, "fast": 7.5, "other": 7.5, "relax": 7.5})
    queue_limit: dict = field(default_factory=lambda: {"turbo": 32, "fast": 64, "other": 64, "relax": 256})
    min_share: float = 0.1
    policy: batching.BatchPolicy = batching.BatchPolicy.STEP_PRIORITY
    co_batch_slack: float = 0.25

    @classmethod
    def from_config(cls, cfg, **overrides) -> "EngineSettings":
        base = cls()
        # a partial per-tier table in the file overrides only the tiers it names
        return cls(max_batch=cfg.max_batch, steps={**base.steps, **cfg.steps},
                   sampler={**base.sampler, **cfg.sampler}, guidance={**base.guidance, **cfg.guidance},
                   queue_limit={**base.queue_limit, **cfg.queue_limit}, min_share=cfg.min_share, **overrides)


class Engine:
    keep_images = 64  # of the finished jobs kept, the newest done ones whose images are still held

    def __init__(self, backend, encoder, components, settings: EngineSettings | None = None, *,
                 throttle: ThrottleState | None = None, metrics=None, clock=time.monotonic, wall=time.time,
                 on_event: Callable[[dict], None] | None = None):
        self.backend = backend
        self.encoder = encoder
        self.scheduler_config = components.scheduler_config
        self.vae_scale_factor = components.vae_scale_factor
        # sizes must survive the VAE's and the UNet's downsampling without remainders
        self.size_multiple = self.vae_scale_factor * 2 ** (len(components.unet.config.block_out_channels) - 1)
        self.settings = settings or EngineSettings()
        self.throttle = throttle or ThrottleState(clock=clock, wall=wall)
        self.metrics = metrics
        self.clock, self.wall = clock, wall
        self.on_event = on_event
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._jobs: dict[str, Job] = {}                          # every job, live and recent
        self._finished: collections.deque = collections.deque()  # terminal job ids, oldest first
        self._holding_images: collections.deque = collections.deque()  # done jobs with images, oldest first
        self._active: dict[str, Job] = {}                        # not terminal yet
        self._seq = itertools.count()
        self._credits: dict[str, float] = {}
        self._decode_deferred = 0
        self._intake_open = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.step_times: collections.deque = collections.deque(maxlen=RECENT)
        self.queue_waits = {t: collections.deque(maxlen=RECENT) for t in PRIORITY_ORDER}
        self.decode_s_per_image: float | None = None
        self.step_cost: dict[tuple, float] = {}  # (shape, UNet rows) -> smoothed step seconds
        self.steps_total = 0
        self.heartbeat = clock()

    # ---- limits -----------------------------------------------------------------------

    def limits(self) -> batching.Limits:
        t = self.throttle.current()
        max_batch = self.settings.max_batch
        if t is not None and t.max_batch is not None:
            max_batch = min(max_batch, t.max_batch)
        # while draining, paused work runs too: shutdown must not wait on a throttle
        paused = t.paused_tiers if t is not None and self._intake_open else frozenset()
        return batching.Limits(max_batch, paused, self.settings.min_share,
                             dict(self.step_cost), self.settings.co_batch_slack)

    def steps_for(self, tier: str, requested: int) -> int:
        t = self.throttle.current()
        cap = t.step_caps.get(tier) if t else None
        return min(requested, cap) if cap else requested

    # ---- intake (any thread) ----------------------------------------------------------

    def _queued(self, tier: str) -> int:
        return sum(1 for j in self._active.values() if j.tier == tier and j.state is JobState.QUEUED)

    def _retry_after(self, tier: str) -> float:
        """Rough seconds until the tier's queue has room: its queued steps at the current pace."""
        step = percentile(self.step_times, 50) or 0.1
        queued_steps = sum(s.total_steps - s.step for j in self._active.values() if j.tier == tier
                           for s in j.samples)
        return max(1.0, math.ceil(step * queued_steps / max(1, self.limits().max_batch)))

    def submit(self, request: JobRequest) -> Job:
        """Queue a job; raises Draining, TierShed or QueueFull (all Rejected) when it cannot."""
        with self._lock:
            if not self._intake_open:
                raise Draining("the worker is shutting down and takes no new jobs", retry_after=5)
            t = self.throttle.current()
            if t is not None and request.tier in t.shed_tiers:
                left = max(1.0, math.ceil(t.expires_at - self.clock()))
                raise TierShed(f"tier {request.tier} is shed by the node's throttle ({t.reason})", retry_after=left)
            limit = self.settings.queue_limit[request.tier]
            if self._queued(request.tier) >= limit:
                raise QueueFull(f"tier {request.tier} queue is full ({limit} jobs waiting)",
                                retry_after=self._retry_after(request.tier))
            job = Job(request, next(self._seq), self.clock(), self.wall())
            self._jobs[job.id] = job
            self._active[job.id] = job
            self._wake.notify_all()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job; a queued one leaves the queue at once, a running one at the next boundary."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state.terminal:
                return job
            job.cancel_requested = True
            if job.state is JobState.QUEUED:
                self._finish(job, JobState.CANCELLED, "cancelled by the client")
            self._wake.notify_all()
            return job

    # ---- job completion ---------------------------------------------------------------

    def _finish(self, job: Job, state: JobState, error: str | None = None) -> None:
        """Move a job to a terminal state (lock held) and resolve its future."""
        if job.state.terminal:
            return
        job.state, job.error, job.finished = state, error, self.clock()
        self._active.pop(job.id, None)
        self._finished.append(job.id)
        while len(self._finished) > KEEP_FINISHED:
            self._jobs.pop(self._finished.popleft(), None)
        if state is JobState.DONE:
            self._holding_images.append(job)
            while len(self._holding_images) > self.keep_images:
                self._holding_images.popleft().drop_images()
        if job.future.done():  # a waiter cancelled the future itself; nobody listens any more
            pass
        elif state is JobState.DONE:
            job.future.set_result(job)
        elif state is JobState.CANCELLED:
            job.future.set_exception(JobCancelled(error or "cancelled"))
        else:
            job.future.set_exception(JobFailed(error or "failed"))
        if self.metrics is not None:
            self.metrics.job_finished(job.tier, state.value)
        self._wake.notify_all()

    def _fail(self, jobs, message: str) -> None:
        with self._lock:
            for job in jobs:
                self._finish(job, JobState.FAILED, message)

    @staticmethod
    def _describe_error(what: str, n: int, exc: BaseException) -> str:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return f"out of memory during {what} of a batch of {n} images; retry, or lower n or size"
        return f"{what} of a batch of {n} images failed: {type(exc).__name__}: {exc}"

    # ---- one boundary -----------------------------------------------------------------

    def _admit(self, jobs: list[Job]) -> None:
        """Text embeddings for new jobs: one encoder call for every prompt not cached."""
        prompts = []
        for job in jobs:
            if job.request.cfg:
                prompts.append(job.request.negative_prompt)
            prompts.append(job.request.prompt)
        try:
            embs = iter(self.encoder.encode(prompts))
        except Exception as exc:  # noqa: BLE001 - fail these jobs, keep serving
            log.exception("text encoding failed")
            self._fail(jobs, f"text encoding failed: {type(exc).__name__}: {exc}")
            return
        for job in jobs:
            rows = [next(embs) for _ in range(2 if job.request.cfg else 1)]
            job.embeddings = torch.stack(rows)

    def _start(self, sample: Sample) -> None:
        """First step of a sample: its own scheduler and seeded initial noise."""
        job = sample.job
        steps = self.steps_for(job.tier, job.request.steps)
        sample.scheduler = make_scheduler(self.settings.sampler[job.tier], self.scheduler_config, steps)
        sample.total_steps = steps
        sample.generator = torch.Generator().manual_seed(sample.seed)
        vsf = self.vae_scale_factor
        shape = (1, 4, job.request.height // vsf, job.request.width // vsf)
        # noise drawn on the CPU so a seed gives the same image on any device
        noise = torch.randn(shape, generator=sample.generator, dtype=torch.float32)
        sample.latents = noise.to(self.backend.device) * sample.scheduler.init_noise_sigma

    def _emit(self, kind: str, samples, seconds: float) -> None:
        if self.on_event is not None:
            self.on_event({"kind": kind, "samples": [(s.job.id, s.job.tier, s.index, s.step) for s in samples],
                           "seconds": seconds, "at": self.clock()})

    def _step(self, samples: list[Sample]) -> None:
        t0 = self.clock()
        try:
            inputs, timesteps, embs, ts = [], [], [], []
            for s in samples:
                if s.scheduler is None:
                    self._start(s)
                t = s.scheduler.timesteps[s.step]
                rows = 2 if s.job.request.cfg else 1
                x = torch.cat([s.latents] * rows)
                inputs.append(s.scheduler.scale_model_input(x, t))
                timesteps.append(torch.full((rows,), float(t)))
                embs.append(s.job.embeddings)
                ts.append(t)
            noise = self.backend.predict_noise(torch.cat(inputs), torch.cat(timesteps), torch.cat(embs)).float()
            offset = 0
            for s, t in zip(samples, ts):
                req = s.job.request
                eps = noise[offset:offset + (2 if req.cfg else 1)]
                offset += len(eps)
                if req.cfg:
                    uncond, cond = eps.chunk(2)
                    eps = uncond + req.guidance * (cond - uncond)
                s.latents = s.scheduler.step(eps, t, s.latents, generator=s.generator, return_dict=False)[0]
                s.step += 1
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the worker
            log.exception("UNet step failed")
            self._after_oom()
            self._fail({s.job for s in samples}, self._describe_error("a denoising step", len(samples), exc))
            return
        seconds = self.clock() - t0
        key = (self._shape(samples[0]), len(noise))
        self.step_cost[key] = _smooth(self.step_cost.get(key), seconds)
        self.step_times.append(seconds)
        self.steps_total += 1
        if self.metrics is not None:
            self.metrics.observe_step(seconds, len(samples))
        with self._lock:
            for s in samples:
                if s.job.state is JobState.RUNNING and all(x.denoised for x in s.job.samples):
                    s.job.state = JobState.DECODING
        self._emit("step", samples, seconds)

    def _decode(self, samples: list[Sample]) -> None:
        t0 = self.clock()
        try:
            images = self.backend.decode(torch.cat([s.latents for s in samples]))
            pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            arrays = pixels.permute(0, 2, 3, 1).cpu().numpy()
        except Exception as exc:  # noqa: BLE001
            log.exception("VAE decode failed")
            self._after_oom()
            self._fail({s.job for s in samples}, self._describe_error("decoding", len(samples), exc))
            return
        seconds = self.clock() - t0
        self.decode_s_per_image = _smooth(self.decode_s_per_image, seconds / len(samples))
        with self._lock:
            for s, arr in zip(samples, arrays):
                s.image = arr
                s.latents = None
            for job in dict.fromkeys(s.job for s in samples):  # in batch order: oldest first
                if all(x.image is not None for x in job.samples):
                    self._finish(job, JobState.DONE)
        self._emit("decode", samples, seconds)

    def _after_oom(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _plan(self):
        """Under the lock: reap cancellations, list jobs to admit, candidates and finished latents."""
        limits = self.limits()
        for job in [j for j in self._active.values() if j.cancel_requested]:
            self._finish(job, JobState.CANCELLED, "cancelled by the client")
        live = [j for j in self._active.values() if j.tier not in limits.paused]
        to_admit = [j for j in live if j.embeddings is None]
        return limits, live, to_admit

    def run_once(self) -> bool:
        """One step boundary; True when it did some work."""
        self.heartbeat = self.clock()
        with self._lock:
            limits, live, to_admit = self._plan()
        if to_admit:
            self._admit(to_admit)
        live = [j for j in live if j.embeddings is not None and not j.state.terminal]
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
            return bool(to_admit)
        if batching.should_decode([s.job.tier for s in finished], [s.job.tier for s in runnable],
                                self._decode_deferred, limits.min_share):
            self._decode_deferred = 0
            return self._run_decode(finished, limits)
        if finished:
            self._decode_deferred += 1
        return self._run_step(runnable, limits)

    def _shape(self, s: Sample) -> tuple:
        return (s.job.request.height, s.job.request.width)

    def _run_decode(self, finished: list[Sample], limits: batching.Limits) -> bool:
        by_key = {s.key: s for s in finished}
        keys = batching.decode_chunk(
            [batching.Finished(s.key, s.job.tier, self._shape(s), s.job.seq) for s in finished],
            limits.max_batch, percentile(self.step_times, 50), self.decode_s_per_image)
        self._decode([by_key[k] for k in keys])
        return True

    def _run_step(self, runnable: list[Sample], limits: batching.Limits) -> bool:
        by_key = {s.key: s for s in runnable}
        cands = [batching.Candidate(s.key, s.job.tier, self._shape(s), s.job.seq, s.scheduler is not None,
                                  2 if s.job.request.cfg else 1) for s in runnable]
        comp = batching.compose_batch(cands, limits, self._credits, self.settings.policy)
        self._credits = comp.credits
        if not comp.keys:
            return False
        batch = [by_key[k] for k in comp.keys]
        now = self.clock()
        with self._lock:
            for s in batch:
                job = s.job
                if job.state is JobState.QUEUED:
                    job.state, job.started = JobState.RUNNING, now
                    wait = now - job.submitted
                    self.queue_waits[job.tier].append(wait)
                    if self.metrics is not None:
                        self.metrics.observe_queue_wait(job.tier, wait)
        self._step(batch)
        return True

    # ---- the thread -------------------------------------------------------------------

    def _idle(self) -> bool:
        limits = self.limits()
        return not any(j.tier not in limits.paused for j in self._active.values())

    def run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                if self._idle():
                    # wake at least every second (heartbeat) and when the throttle expires
                    t = self.throttle.current()
                    self._wake.wait(timeout=min(1.0, t.expires_at - self.clock()) if t else 1.0)
                    self.heartbeat = self.clock()
                    continue
            try:
                did = self.run_once()
            except Exception:  # noqa: BLE001 - a bug in one boundary must not kill the worker
                log.exception("engine boundary failed")
                did = False
            if not did:
                with self._lock:
                    self._wake.wait(timeout=0.05)

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self.run, name="turbonode-engine", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Re-plan now (the throttle changed)."""
        with self._lock:
            self._wake.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- draining ---------------------------------------------------------------------

    def close_intake(self) -> None:
        """Refuse new jobs and fail those that have not started: shutdown finishes only what runs."""
        with self._lock:
            self._intake_open = False
            for job in [j for j in self._active.values() if j.state is JobState.QUEUED]:
                self._finish(job, JobState.FAILED, "the worker is shutting down; the job did not start, resubmit it")

    def wait_idle(self, timeout: float) -> bool:
        deadline = self.clock() + timeout
        with self._lock:
            while self._active:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._wake.wait(timeout=min(left, 0.5))
        return True

    def fail_all(self, message: str) -> int:
        with self._lock:
            jobs = list(self._active.values())
            for job in jobs:
                self._finish(job, JobState.FAILED, message)
        return len(jobs)

    @property
    def accepting(self) -> bool:
        return self._intake_open

    # ---- status -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            tiers = {}
            for t in PRIORITY_ORDER:
                jobs = [j for j in self._active.values() if j.tier == t]
                queued = [j for j in jobs if j.state is JobState.QUEUED]
                tiers[t] = {
                    "queued": len(queued),
                    "in_flight": len(jobs) - len(queued),
                    "oldest_wait_s": round(max((now - j.submitted for j in queued), default=0.0), 4),
                    "queue_wait_p99_s": percentile(self.queue_waits[t], 99),
                }
            steps = list(self.step_times)
        return {
            "tiers": tiers,
            "step_time_s": {"last": steps[-1] if steps else None, "p50": percentile(steps, 50),
                            "p99": percentile(steps, 99)},
            "max_batch": self.limits().max_batch,
            "steps_total": self.steps_total,
            "accepting": self._intake_open,
        }


def _smooth(old: float | None, new: float) -> float:
    """Exponential moving average that starts at the first value."""
    return new if old is None else 0.8 * old + 0.2 * new
