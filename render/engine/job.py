"""A job as the engine runs it, and its images ('samples'): the state it moves from queued to done.

A job is one request (render/jobs.py: prompt, n images, tier, steps, seed, guidance) and, once
encoded, its conditioning (every text encoder's output). Each of its images is a sample whose
denoising state (render/engine/families/base.py `Denoising`: its own diffusers scheduler,
latents and noise generator from seed + index) begins at its first step, so samples batch with
any other job's samples and the same seed gives the same image.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from render.jobs import JobRequest, JobState

if TYPE_CHECKING:
    from .families.base import Conditioning, Denoising


@dataclass(eq=False)
class Sample:
    job: Job
    index: int
    state: Denoising | None = None  # from the sample's first step on (step caps apply then)
    image: Any = None  # uint8 HxWx3 numpy array once decoded

    @property
    def started(self) -> bool:
        return self.state is not None

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else 0

    @property
    def total_steps(self) -> int:
        return self.state.total_steps if self.state is not None else self.job.request.steps

    @property
    def key(self) -> tuple[str, int]:
        return (self.job.id, self.index)

    @property
    def seed(self) -> int:
        return self.job.request.seed + self.index

    @property
    def denoised(self) -> bool:
        return self.state is not None and self.state.done


@dataclass(eq=False)
class Job:
    request: JobRequest
    seq: int
    submitted: float  # monotonic
    created: float  # wall clock, for API answers
    id: str = field(default_factory=lambda: "job-" + uuid.uuid4().hex[:16])
    state: JobState = JobState.QUEUED
    error: str | None = None
    started: float | None = None  # first denoising step (monotonic)
    denoised: float | None = None  # last denoising step done, decode pending
    finished: float | None = None
    cond: Conditioning | None = None  # the prompt's encoding, once the job is admitted
    uncond: Conditioning | None = None  # the negative prompt's, with classifier-free guidance
    cancel_requested: bool = False
    images_dropped: bool = False
    answered = False  # never here: the front answers an in-process job (RemoteJob.answered)
    # engine seconds this job used: its share of every batched denoiser and decoder call it was in
    engine_s: float = 0.0
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = [Sample(self, i) for i in range(self.request.n)]

    def ended(self) -> asyncio.Future:
        """This job's end, awaitable on the running loop; cancelling the wait leaves the job alone."""
        return asyncio.shield(asyncio.wrap_future(self.future))

    def drop_images(self) -> None:
        """Free the pixels once delivered (or too old to keep); the job's record stays."""
        for s in self.samples:
            s.image = None
        self.images_dropped = True

    @property
    def tier(self) -> str:
        return self.request.tier

    @property
    def progress(self) -> float:
        """Fraction of denoising steps and decodes done (decode counts as one step per image)."""
        total = sum(s.total_steps + 1 for s in self.samples)
        done = sum(s.step + (s.image is not None) for s in self.samples)
        return 1.0 if self.state is JobState.DONE else round(done / total, 4)

    def describe(self, now: float) -> dict:
        out = {
            "id": self.id,
            "object": "image.generation.job",
            "state": self.state.value,
            "tier": self.tier,
            "requested_tier": self.request.requested_tier or self.tier,
            "downgraded": self.request.downgraded or None,
            "progress": self.progress,
            "created": int(self.created),
            "steps": max((s.total_steps for s in self.samples), default=self.request.steps),
            "step": min((s.step for s in self.samples), default=0),  # of the least advanced image
            "seed": self.request.seed,
            "n": self.request.n,
            "size": f"{self.request.width}x{self.request.height}",
            "engine_s": round(self.engine_s, 6),
        }
        if self.request.account:
            out["account"] = self.request.account
        if self.started is not None:
            out["queue_wait_s"] = round(self.started - self.submitted, 4)
        if self.finished is not None:
            out["elapsed_s"] = round(self.finished - self.submitted, 4)
        else:
            out["age_s"] = round(now - self.submitted, 4)
        if self.error:
            out["error"] = self.error
        if self.images_dropped:
            out["images"] = "delivered or expired; no longer held"
        return out
