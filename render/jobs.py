"""What a job is on both sides of the link: its request, the defaults a request falls back on,
its states and how it can be refused or fail. The front builds the requests and waits for the
ends; the engine (render/engine/job.py: a job as it runs, with its images) moves them from
queued to done. Each of them travels between the processes as it is (render/link.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from turbonode.errors import ConfigError, TurbonodeError
from turbonode.tier_headers import DOWNGRADED_HEADER, REQUESTED_TIER_HEADER, TIER_HEADER


class JobState(str, enum.Enum):
    QUEUED = "queued"  # waiting for its first step
    RUNNING = "running"  # denoising
    DECODING = "decoding"  # every sample denoised, VAE decode pending
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


class JobFailed(TurbonodeError):
    """The job failed (batch error, out of memory, shutdown); the message says why."""


class JobCancelled(TurbonodeError):
    """The job was cancelled by its client."""


class Rejected(TurbonodeError):
    """A submission the worker cannot take now; `status` is the HTTP status to answer."""

    status = 429

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):  # crosses the pipe from the engine process with its Retry-After
        return (type(self), (str(self), self.retry_after))


class QueueFull(Rejected):
    pass


class TierShed(Rejected):
    pass


class Draining(Rejected):
    status = 503


@dataclass(frozen=True)
class JobRequest:
    prompt: str
    tier: str
    steps: int
    seed: int
    guidance: float
    width: int
    height: int
    n: int = 1
    negative_prompt: str = ""
    # who asked, and what (the front decides: docs/worker.md, "Accounts"); the job record shows them
    account: str = ""  # the key's name ('' without keys)
    requested_tier: str = ""  # the tier asked for, when `tier` is another ('' = the same)
    downgraded: str = ""  # why `tier` is not the one asked for (turbonode.tier_headers.DOWNGRADE_REASONS)


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that names no size, steps or guidance gets, and the sizes it may name: the
    engine checks them against its model when it loads and sends them; the front's HTTP API fills
    each request in with them."""

    size: int
    size_multiple: int
    steps: Mapping[str, int]
    guidance: Mapping[str, float]
    size_check: Callable[[int, int], str | None] | None = None  # Backend.unsupported_size(height, width)

    def __post_init__(self) -> None:
        # worker.size is every request's default: one the model cannot render stops the worker at
        # start, instead of every request without a size being refused (or silently resized)
        if self.size % self.size_multiple:
            raise ConfigError(
                "worker.size", f"{self.size} is not a multiple of {self.size_multiple}, the model's size step"
            )
        reason = self.size_check(self.size, self.size) if self.size_check else None
        if reason:
            raise ConfigError("worker.size", f"{self.size}: {reason}")


def tier_headers(job_request: JobRequest) -> dict[str, str]:
    """What every answer about a job says of its tier: the tier that serves it and, when that is not
    the one asked for, which was and why."""
    headers = {TIER_HEADER: job_request.tier}
    if job_request.downgraded:
        headers[DOWNGRADED_HEADER] = job_request.downgraded
        headers[REQUESTED_TIER_HEADER] = job_request.requested_tier
    return headers


def images_data(pngs: list[str], prompt: str) -> list[dict]:
    """A done job's images as OpenAI's images response lists them (base64 PNGs)."""
    return [{"b64_json": png, "revised_prompt": prompt} for png in pngs]


def images_answer(created: float, pngs: list[str], prompt: str, described: dict) -> dict:
    """A sync request's answer (OpenAI's images response, with the job's description), as the front
    or the engine process writes it."""
    return {"created": int(created), "data": images_data(pngs, prompt), "turbonode": described}
