"""What a worker throttle may limit, validated once for both sides of the control socket.

The agent's `[policy.actions.<level>]` tables (turbonode.config) and the worker's `throttle`
method (render/throttle.py) check the same parameters with this function, so a level the
config accepts is a throttle the worker accepts. The protected tier (turbonode.tiers) can
never be paused, shed or step-capped: protecting it is why the throttle exists. It may be
*unready*: `unready_tiers` throttles nothing, it makes the worker report those tiers not
ready (GET /readyz?tier=T) so that a balancer sends their new work to another node.
`intra_op_threads` limits no tier: it is how many CPU threads each UNet/VAE call uses, fewer
while the node's CPUs are contended (the agent's worker_threads lever, render/cpu_threads.py).
`lock_memory` limits none either: the worker keeps its pages resident while it lasts (the
agent's memory_protect lever, render/memory_lock.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tiers import PROTECTED_TIER, TIER_NAMES

THROTTLE_KEYS: tuple[str, ...] = (
    "max_batch",
    "paused_tiers",
    "step_caps",
    "shed_tiers",
    "unready_tiers",
    "intra_op_threads",
    "lock_memory",
)
# JSON-RPC error code (implementation-defined server error range) of a `throttle` or `release`
# refused because an operator hold is in force; the error's data carries {"hold": the throttle}.
THROTTLE_HELD = -32001
# The longest lease the worker grants (render/throttle.py); agent.throttle_ttl may not exceed it.
MAX_THROTTLE_TTL_S = 3600.0
# The shortest: a lease of less than a millisecond lapses before the call that sets it returns.
MIN_THROTTLE_TTL_S = 0.001
# Upper bounds of the limits (and of the worker's own settings they lower, turbonode.config):
# a value past them means nothing a worker can do, so it is refused rather than carried around.
MAX_BATCH = 1024  # rows in one denoiser call: more than any GPU holds
MAX_STEPS = 200  # steps a job may ask for (the HTTP API refuses more): a cap above it caps nothing
MAX_INTRA_OP_THREADS = 1024


@dataclass(frozen=True)
class ThrottleLimits:
    max_batch: int | None = None
    paused_tiers: frozenset[str] = frozenset()
    step_caps: dict[str, int] = field(default_factory=dict)
    shed_tiers: frozenset[str] = frozenset()
    unready_tiers: frozenset[str] = frozenset()
    intra_op_threads: int | None = None
    lock_memory: bool = False


def _count(v: Any, most: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= most


def _tiers(name: str, value: Any, protected_allowed: bool = False) -> frozenset[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name} must be a list of tier names")
    for t in value:
        if t not in TIER_NAMES:
            raise ValueError(f"{name}: unknown tier {t!r} (expected one of {', '.join(TIER_NAMES)})")
    if PROTECTED_TIER in value and not protected_allowed:
        raise ValueError(f"{name}: the {PROTECTED_TIER} tier cannot be throttled")
    return frozenset(value)


def check_ttl(ttl_s: Any, limit: float = MAX_THROTTLE_TTL_S) -> float:
    """A throttle's lease in seconds, in [MIN_THROTTLE_TTL_S, limit]; ValueError names the range."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not MIN_THROTTLE_TTL_S <= ttl_s <= limit:
        raise ValueError(f"must be a number of seconds in [{MIN_THROTTLE_TTL_S:g}, {limit:g}], got {ttl_s!r}")
    return float(ttl_s)


def check_throttle(
    max_batch: Any = None,
    paused_tiers: Any = (),
    step_caps: Any = None,
    shed_tiers: Any = (),
    unready_tiers: Any = (),
    intra_op_threads: Any = None,
    lock_memory: Any = False,
) -> ThrottleLimits:
    """Validate the throttle's limits; ValueError names the bad parameter first."""
    if max_batch is not None and not _count(max_batch, MAX_BATCH):
        raise ValueError(f"max_batch must be an integer 1..{MAX_BATCH} or null, got {max_batch!r}")
    if intra_op_threads is not None and not _count(intra_op_threads, MAX_INTRA_OP_THREADS):
        raise ValueError(
            f"intra_op_threads must be an integer 1..{MAX_INTRA_OP_THREADS} or null, got {intra_op_threads!r}"
        )
    if not isinstance(lock_memory, bool):
        raise ValueError(f"lock_memory must be true or false, got {lock_memory!r}")
    step_caps = {} if step_caps is None else step_caps
    if not isinstance(step_caps, dict):
        raise ValueError("step_caps must be an object {tier: steps}")
    _tiers("step_caps", list(step_caps))
    for t, cap in step_caps.items():
        if not _count(cap, MAX_STEPS):
            raise ValueError(f"step_caps.{t} must be an integer 1..{MAX_STEPS}, got {cap!r}")
    return ThrottleLimits(
        max_batch,
        _tiers("paused_tiers", paused_tiers),
        dict(step_caps),
        _tiers("shed_tiers", shed_tiers),
        _tiers("unready_tiers", unready_tiers, protected_allowed=True),
        intra_op_threads,
        lock_memory,
    )
