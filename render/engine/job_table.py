"""The job table: every job, live and recent, with admission, cancellation and draining.

Other threads (HTTP, control socket) submit, cancel and look jobs up; the engine thread moves
them to running and to a terminal state. One re-entrant lock guards the table and a
condition on it (`wake`) wakes the engine's loop and whoever waits for the table to empty.

Admission refuses, with the HTTP status and Retry-After the API answers: any job while the
worker drains (503), a tier the agent's throttle sheds (429 until the throttle expires), a
tier whose queue is full (429, with a rough time until it has room).
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from render.jobs import Draining, JobCancelled, JobFailed, JobRequest, JobState, QueueFull, TierShed
from render.throttle import ThrottleState
from turbonode.stats import percentile
from turbonode.tiers import PRIORITY_ORDER

from .job import Job

RECENT = 512  # queue waits (and the engine's step times) kept for p50/p99 figures
KEEP_FINISHED = 1024  # terminal jobs kept for GET /v1/jobs/{id}

Pace = Callable[[], "tuple[float | None, int]"]  # -> (median step seconds or None, max batch now)


class JobTable:
    keep_images = 64  # of the finished jobs kept, the newest done ones whose images are still held

    def __init__(
        self,
        queue_limit: Mapping[str, int],
        throttle: ThrottleState,
        pace: Pace,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        metrics: Any = None,
    ):
        self.queue_limit = queue_limit
        self.throttle = throttle
        self.pace = pace
        self.clock, self.wall = clock, wall
        self.metrics = metrics
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self._jobs: dict[str, Job] = {}  # every job, live and recent
        self._finished: collections.deque[str] = collections.deque()  # terminal job ids, oldest first
        self._holding_images: collections.deque[Job] = collections.deque()  # done jobs with images, oldest first
        self._active: dict[str, Job] = {}  # not terminal yet
        self._seq = itertools.count()
        self._intake_open = True
        self.queue_waits: dict[str, collections.deque[float]] = {
            t: collections.deque(maxlen=RECENT) for t in PRIORITY_ORDER
        }

    # ---- intake (any thread) ----------------------------------------------------------

    def _queued(self, tier: str) -> int:
        return sum(1 for j in self._active.values() if j.tier == tier and j.state is JobState.QUEUED)

    def _retry_after(self, tier: str) -> float:
        """Rough seconds until the tier's queue has room: its queued steps at the current pace."""
        step_s, max_batch = self.pace()
        queued_steps = sum(s.total_steps - s.step for j in self._active.values() if j.tier == tier for s in j.samples)
        return max(1.0, math.ceil((step_s or 0.1) * queued_steps / max(1, max_batch)))

    def submit(self, request: JobRequest) -> Job:
        """Queue a job; raises Draining, TierShed or QueueFull (all Rejected) when it cannot."""
        with self.lock:
            if not self._intake_open:
                raise Draining("the worker is shutting down and takes no new jobs", retry_after=5)
            t = self.throttle.current()
            if t is not None and request.tier in t.shed_tiers:
                left = max(1.0, math.ceil(t.expires_at - self.clock()))
                raise TierShed(f"tier {request.tier} is shed by the node's throttle ({t.reason})", retry_after=left)
            limit = self.queue_limit[request.tier]
            if self._queued(request.tier) >= limit:
                raise QueueFull(
                    f"tier {request.tier} queue is full ({limit} jobs waiting)",
                    retry_after=self._retry_after(request.tier),
                )
            job = Job(request, next(self._seq), self.clock(), self.wall())
            self._jobs[job.id] = job
            self._active[job.id] = job
            self.wake.notify_all()
        return job

    def get(self, job_id: str) -> Job | None:
        with self.lock:
            return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job; a queued one leaves the queue at once, a running one at the next boundary."""
        with self.lock:
            job = self._jobs.get(job_id)
            if job is None or job.state.terminal:
                return job
            job.cancel_requested = True
            if job.state is JobState.QUEUED:
                self.finish(job, JobState.CANCELLED, "cancelled by the client")
            self.wake.notify_all()
            return job

    # ---- the engine thread ------------------------------------------------------------

    def live(self) -> list[Job]:
        """Reap cancellations; the jobs that are not terminal, in arrival order."""
        with self.lock:
            for job in [j for j in self._active.values() if j.cancel_requested]:
                self.finish(job, JobState.CANCELLED, "cancelled by the client")
            return list(self._active.values())

    def pending(self) -> list[Job]:
        """The jobs that are not terminal, in arrival order (nothing reaped: for status)."""
        with self.lock:
            return list(self._active.values())

    def has_work(self, paused: Iterable[str]) -> bool:
        paused = frozenset(paused)
        with self.lock:
            return any(j.tier not in paused for j in self._active.values())

    def mark_running(self, jobs: Iterable[Job], now: float) -> None:
        """Jobs whose first step is about to run: record how long they waited."""
        with self.lock:
            for job in jobs:
                if job.state is JobState.QUEUED:
                    job.state, job.started = JobState.RUNNING, now
                    wait = now - job.submitted
                    self.queue_waits[job.tier].append(wait)
                    if self.metrics is not None:
                        self.metrics.observe_stage(job.tier, "queue_wait", wait)

    def finish(self, job: Job, state: JobState, error: str | None = None) -> None:
        """Move a job to a terminal state and resolve its future."""
        with self.lock:
            if job.state.terminal:
                return
            job.state, job.error, job.finished = state, error, self.clock()
            # the kept record needs no prompt encoding (the encoder's cache keeps the hot ones):
            # a thousand kept jobs would pin a thousand of them, ~0.5 MB each for SD 1.5 with CFG
            job.cond = job.uncond = None
            self._active.pop(job.id, None)
            self._finished.append(job.id)
            while len(self._finished) > KEEP_FINISHED:
                self._jobs.pop(self._finished.popleft(), None)
            if state is JobState.DONE:
                if self.metrics is not None and job.denoised is not None:
                    self.metrics.observe_stage(job.tier, "decode", job.finished - job.denoised)
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
            self.wake.notify_all()

    def fail(self, jobs: Iterable[Job], message: str) -> None:
        with self.lock:
            for job in jobs:
                self.finish(job, JobState.FAILED, message)

    # ---- draining ---------------------------------------------------------------------

    def close_intake(self) -> tuple[int, int]:
        """Refuse new jobs and fail those that have not started: shutdown finishes only what runs.
        Returns (jobs failed, jobs still running)."""
        with self.lock:
            self._intake_open = False
            queued = [j for j in self._active.values() if j.state is JobState.QUEUED]
            self.fail(queued, "the worker is shutting down; the job did not start, resubmit it")
            return len(queued), len(self._active)

    def wait_idle(self, timeout: float) -> bool:
        deadline = self.clock() + timeout
        with self.lock:
            while self._active:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self.wake.wait(timeout=min(left, 0.5))
        return True

    def fail_all(self, message: str) -> int:
        with self.lock:
            jobs = list(self._active.values())
            self.fail(jobs, message)
        return len(jobs)

    @property
    def accepting(self) -> bool:
        return self._intake_open

    # ---- status -----------------------------------------------------------------------

    def tiers(self, now: float) -> dict[str, dict]:
        """Per tier: queued, in flight, the oldest queued job's wait, the p99 of recent waits."""
        with self.lock:
            out = {}
            for t in PRIORITY_ORDER:
                jobs = [j for j in self._active.values() if j.tier == t]
                queued = [j for j in jobs if j.state is JobState.QUEUED]
                out[t] = {
                    "queued": len(queued),
                    "in_flight": len(jobs) - len(queued),
                    "oldest_wait_s": round(max((now - j.submitted for j in queued), default=0.0), 4),
                    "queue_wait_p99_s": percentile(self.queue_waits[t], 99),
                }
            return out
