"""Which tier a request runs in, and why not the one it asked for (pure; docs/worker.md, "Accounts").

From the tier it may start at (the one asked for, or the default when the asking header was not
the balancer's), down the tiers in priority order, never up: the first tier the key may use
(`allowed`), whose budget is not spent (`spent`), and that the node's throttle neither sheds nor
pauses. The reason given is the first that moved the request down. Where no tier is open:

* a tier that is only shed or paused still takes the request (the first the key may use and
  can pay for): its job is refused 429 there (shed) or waits (paused), as without accounts;
* every tier the key may use below the start spent: refused, `insufficient_quota` (429);
* no tier at or below the start that the key may use: refused, `not_entitled` (403).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from turbonode.tier_headers import BUDGET, HEADER_IGNORED, NOT_ENTITLED, PAUSED, SHED
from turbonode.tiers import PRIORITY_ORDER


@dataclass(frozen=True)
class Grant:
    tier: str | None  # None: refused (`reason` says why: budget or not_entitled)
    requested: str
    reason: str = ""  # '' when it runs in the tier asked for

    @property
    def downgraded(self) -> bool:
        return self.tier is not None and self.tier != self.requested


def grant(
    requested: str,
    start: str,
    allowed: Collection[str],
    spent: Collection[str] = (),
    shed: Collection[str] = (),
    paused: Collection[str] = (),
) -> Grant:
    """`requested`: what the client asked for; `start`: the highest tier it may have (the same,
    or lower when its header was ignored); `spent`: tiers whose budget is spent this period."""
    reason = HEADER_IGNORED if start != requested else ""
    below = PRIORITY_ORDER[PRIORITY_ORDER.index(start) :]
    payable = [t for t in below if t in allowed and t not in spent]
    for tier in below:
        why = (
            NOT_ENTITLED
            if tier not in allowed
            else BUDGET
            if tier in spent
            else SHED
            if tier in shed
            else PAUSED
            if tier in paused
            else ""
        )
        if not why:
            return Grant(tier, requested, reason if tier != requested else "")
        reason = reason or why
    if payable:  # only the throttle stands in the way: the job table answers for it
        return Grant(payable[0], requested, reason if payable[0] != requested else "")
    if any(t in allowed for t in below):
        return Grant(None, requested, BUDGET)
    return Grant(None, requested, NOT_ENTITLED)
