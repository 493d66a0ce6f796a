"""The tier table (docs/design.md, tiers): one place for DSCP defaults, HTB classes and shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    name: str
    index: int  # value stored in the BPF DSCP->tier map and the counters' key
    class_minor: int  # HTB class 1:<minor> (hex minor, as tc prints it)
    prio: int  # HTB prio: lower is served first
    rate_pct: int  # guaranteed share of the link
    ceil_pct: int  # ceiling as share of the link
    dscp: int  # DSCP the worker marks its sockets with for this tier
    # HTB class 1:<limit_minor> that holds the tier's lowered ceiling (0: none). The classifier
    # steers the tier there only while the agent's lease on the limit is fresh (docs/qos.md).
    limit_minor: int = 0


TIERS: tuple[Tier, ...] = (
    Tier("turbo", 0, 0x10, 0, 90, 100, 46),
    Tier("fast", 1, 0x20, 1, 5, 100, 34),
    Tier("other", 2, 0x30, 2, 3, 100, 0),
    Tier("relax", 3, 0x40, 3, 2, 100, 8, limit_minor=0x41),
)
TIER_NAMES: tuple[str, ...] = tuple(t.name for t in TIERS)
BY_NAME: dict[str, Tier] = {t.name: t for t in TIERS}
BY_INDEX: dict[int, Tier] = {t.index: t for t in TIERS}
DEFAULT_TIER = "other"

# Priority order used by the worker's scheduler: first is served first.
PRIORITY_ORDER: tuple[str, ...] = tuple(t.name for t in sorted(TIERS, key=lambda t: t.prio))
# The tier the node exists to keep fast: never paused, shed or step-capped, never slowed by others.
PROTECTED_TIER: str = PRIORITY_ORDER[0]

# DSCP code points that are not 'other' by default (EF, AF41/42/43, CS1, LE).
DEFAULT_DSCP_MAP: dict[int, str] = {46: "turbo", 34: "fast", 36: "fast", 38: "fast", 8: "relax", 1: "relax"}


def tier(name: str) -> Tier:
    """Look a tier up by name; raises ValueError naming the valid tiers."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r} (expected one of {', '.join(TIER_NAMES)})") from None


def full_dscp_map(overrides: dict[int, str] | None = None) -> list[int]:
    """All 64 DSCP values -> tier index, defaults first, then overrides."""
    table = [BY_NAME[DEFAULT_TIER].index] * 64
    for dscp, name in {**DEFAULT_DSCP_MAP, **(overrides or {})}.items():
        if not 0 <= dscp < 64:
            raise ValueError(f"DSCP {dscp} out of range 0..63")
        table[dscp] = tier(name).index
    return table


def tos_byte(name: str) -> int:
    """The IP TOS / traffic-class byte for a tier's DSCP (ECN bits zero)."""
    return tier(name).dscp << 2
