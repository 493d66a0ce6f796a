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

from dataclasses import dataclass, field, fields
from typing import Any

from .tiers import PROTECTED_TIER, TIER_NAMES

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
    """What a throttle limits: the one list of its fields, in the order the worker describes them.
    THROTTLE_KEYS, the agent's `[policy.actions.<level>]` keys (turbonode.config), the worker's
    `throttle` call (render/front/control_server.py), its check (check_throttle) and the throttle's
    description (render/throttle.py) all follow it."""

    max_batch: int | None = None
    paused_tiers: frozenset[str] = frozenset()
    step_caps: dict[str, int] = field(default_factory=dict)
    shed_tiers: frozenset[str] = frozenset()
    unready_tiers: frozenset[str] = frozenset()
    intra_op_threads: int | None = None
    lock_memory: bool = False

    def limits(self) -> dict[str, Any]:
        """The limits alone, by name (for a subclass too)."""
        return {key: getattr(self, key) for key in THROTTLE_KEYS}

    def describe_limits(self) -> dict[str, Any]:
        """The limits as JSON answers them: tier sets sorted, in field order."""
        return {key: _plain(value) for key, value in self.limits().items()}


THROTTLE_KEYS: tuple[str, ...] = tuple(f.name for f in fields(ThrottleLimits))


def _plain(value: Any) -> Any:
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _count(v: Any, most: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= most


def _tiers(name: str, value: Any, protected_allowed: bool = False) -> frozenset[str]:
    if not isinstance(value, (list, tuple, frozenset)) or not all(isinstance(t, str) for t in value):
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


def check_throttle(**params: Any) -> ThrottleLimits:
    """Validate the throttle's limits (ThrottleLimits' fields, by name; the others keep their
    defaults); ValueError names the bad parameter first, TypeError a name that is none of them."""
    given = ThrottleLimits(**params)  # not checked yet: only named
    max_batch, step_caps, intra_op_threads, lock_memory = (
        given.max_batch,
        given.step_caps,
        given.intra_op_threads,
        given.lock_memory,
    )
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
        max_batch=max_batch,
        paused_tiers=_tiers("paused_tiers", given.paused_tiers),
        step_caps=dict(step_caps),
        shed_tiers=_tiers("shed_tiers", given.shed_tiers),
        unready_tiers=_tiers("unready_tiers", given.unready_tiers, protected_allowed=True),
        intra_op_threads=intra_op_threads,
        lock_memory=lock_memory,
    )
