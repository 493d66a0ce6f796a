"""Whether the worker takes new work, per tier: what GET /readyz?tier=T answers, what
`turbonode_worker_ready` exports, and - with worker.refuse_unready - whether a new request
of the tier gets a fast 503 with Retry-After instead of a place in the queue.

Pure: the caller passes what the worker knows. A tier is not ready when
- the worker is loading its model, draining or stopped (every tier);
- the agent says so: its throttle lease names the tier in `unready_tiers` (by default at
  level critical for turbo, see turbonode/config/rules.py) or sheds it. A lease expires unless
  renewed, so a dead agent never leaves the node unready;
- the worker's own queue says so: a job of the tier has waited longer than half of the
  tier's objective (worker.slo), so a new one would queue behind it and miss the objective.
  The other half is for denoising, decoding and the answer. This needs no agent, and clears
  itself as soon as the queue drains (with refuse_unready, that is what the 503s do);
- a new job of the tier would finish after the tier's objective, as render/front/admission.py
  predicts from the work ahead of it and the engine's measured pace (a job with nothing ahead
  of it is always welcome).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .admission import Prediction

# the share of a tier's objective its queue wait may use before the tier reports not ready
WAIT_SHARE = 0.5
DRAIN_RETRY_S = 5.0
LOADING_RETRY_S = 10.0
# An engine whose loop has not come round for this long is stuck: not alive (GET /livez 503,
# and no systemd watchdog ping).
ENGINE_STALL_S = 60.0


class Phase(str, enum.Enum):
    LOADING = "loading"  # the HTTP server is up, the model is not
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: running jobs finish, no new ones
    STOPPED = "stopped"  # the engine thread is gone


@dataclass(frozen=True)
class Readiness:
    ready: bool
    status: str  # ready | loading | draining | stopped | not ready | shed
    reason: str = ""
    retry_after: float | None = None  # seconds, for a 503's Retry-After

    def retry_after_header(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.retry_after is not None else {}


@dataclass(frozen=True)
class TierView:
    """What the worker knows about one tier at this moment."""

    unready_by_agent: bool = False  # named in the lease's unready_tiers
    shed_by_agent: bool = False  # named in the lease's shed_tiers (new work gets 429)
    agent_reason: str = ""
    lease_left_s: float = 0.0
    oldest_wait_s: float = 0.0  # the longest a queued job of the tier has waited now
    objective_s: float | None = None  # worker.slo for the tier, if any
    prediction: Prediction | None = None  # when a new job of the tier would finish (render/front/admission.py)


def readiness(phase: Phase, tier: str | None = None, view: TierView | None = None) -> Readiness:
    """The worker's readiness (tier None) or a tier's, from what `view` says of it."""
    if phase is Phase.LOADING:
        return Readiness(False, "loading", "the model is loading", LOADING_RETRY_S)
    if phase is Phase.DRAINING:
        return Readiness(False, "draining", "the worker is shutting down", DRAIN_RETRY_S)
    if phase is Phase.STOPPED:
        return Readiness(False, "stopped", "the engine has stopped")
    if tier is None or view is None:
        return Readiness(True, "ready")
    lease = max(1.0, view.lease_left_s)
    if view.unready_by_agent:
        return Readiness(False, "not ready", f"the node's agent: {view.agent_reason}", lease)
    if view.shed_by_agent:
        return Readiness(False, "shed", f"{tier} is shed by the node's agent: {view.agent_reason}", lease)
    if view.objective_s is not None and view.oldest_wait_s > WAIT_SHARE * view.objective_s:
        budget = WAIT_SHARE * view.objective_s
        return Readiness(
            False,
            "not ready",
            f"a queued {tier} job has waited {view.oldest_wait_s:.2f} s, more than {budget:g} s "
            f"(half of its {view.objective_s:g} s objective)",
            max(1.0, budget),
        )
    p = view.prediction
    if view.objective_s is not None and p is not None and p.misses(view.objective_s):
        return Readiness(
            False,
            "not ready",
            f"a new {tier} job would finish {p.seconds:.2f} s from now or later ({p.ahead} images ahead of it), "
            f"over its {view.objective_s:g} s objective",
            p.retry_after(view.objective_s),
        )
    return Readiness(True, "ready")
