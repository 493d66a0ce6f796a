"""What the QoS datapath may be configured with, validated once for both sides.

`turboctl config check` ([qos] in turbonode.config), `turboctl qos` options and the tree
builder (tc/tree.py, what the agent applies) check link rate, per-tier shares and leaf
limits with these functions, so a configuration the check accepts is a tree the kernel takes.
"""

from __future__ import annotations

from collections.abc import Mapping

from .rates import format_rate
from .tiers import TIER_NAMES, TIERS

# A class's token bucket holds at least two frames (tc/tree.py); pyroute2 encodes the time to send
# them in the kernel's 32-bit tick count, which overflows below ~89 bit/s (measured: an 80 bit/s
# class fails to pack, 100 bit/s applies). 640 bit/s keeps a wide margin.
MIN_CLASS_RATE_BPS = 640
# The smallest tier share is 1 % of the link: then every class gets at least MIN_CLASS_RATE_BPS.
MIN_LINK_RATE_BPS = 100 * MIN_CLASS_RATE_BPS
MAX_LINK_RATE_BPS = 10**13  # 10 tbit: HTB's 64-bit rates go higher; no NIC does
# Packets per leaf queue: pyroute2 packs pfifo's limit as a signed 32-bit integer.
MAX_LEAF_LIMIT = 2**31 - 1


class ShareError(ValueError):
    """A per-tier share is wrong; `field` is rate_pct or ceil_pct, the message names the tier."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def check_rate(bits_per_s: int, lo: int = MIN_CLASS_RATE_BPS, what: str = "rate") -> int:
    """`bits_per_s` within [lo, MAX_LINK_RATE_BPS]; ValueError names the range."""
    if not lo <= bits_per_s <= MAX_LINK_RATE_BPS:
        raise ValueError(
            f"{what} {format_rate(bits_per_s)} is out of range: must be between "
            f"{format_rate(lo)} and {format_rate(MAX_LINK_RATE_BPS)}"
        )
    return bits_per_s


def check_link_rate(bits_per_s: int) -> int:
    return check_rate(bits_per_s, MIN_LINK_RATE_BPS, "link rate")


def check_leaf_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LEAF_LIMIT:
        raise ValueError(f"must be between 1 and {MAX_LEAF_LIMIT} packets, got {limit}")
    return limit


def check_percent(pct: object) -> None:
    if isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100:
        raise ValueError(f"must be a percent 1..100, got {pct!r}")


def check_shares(
    rate_pct: Mapping[str, int] | None = None, ceil_pct: Mapping[str, int] | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """Every tier's guaranteed share and ceiling in percent of the link: the tier table's defaults
    with these overrides. Each is 1..100, a ceiling at least its tier's rate, and the guaranteed
    shares add up to at most 100 % (HTB cannot guarantee more than the link). Raises ShareError."""
    rates = {t.name: t.rate_pct for t in TIERS} | dict(rate_pct or {})
    ceils = {t.name: t.ceil_pct for t in TIERS} | dict(ceil_pct or {})
    for field, table in (("rate_pct", rates), ("ceil_pct", ceils)):
        for name, pct in table.items():
            if name not in TIER_NAMES:
                raise ShareError(field, f"unknown tier {name!r} (expected one of {', '.join(TIER_NAMES)})")
            try:
                check_percent(pct)
            except ValueError as exc:
                raise ShareError(field, f"{name}: {exc}") from None
    total = sum(rates.values())
    if total > 100:
        shares = ", ".join(f"{name} {pct}" for name, pct in rates.items())
        raise ShareError("rate_pct", f"guaranteed shares add up to {total} % ({shares}): at most 100 %")
    for name in TIER_NAMES:
        if ceils[name] < rates[name]:
            raise ShareError("ceil_pct", f"{name}: {ceils[name]} % is below its rate_pct ({rates[name]} %)")
    return rates, ceils
