"""Per-tier view of the datapath: BPF counters next to the HTB class statistics (pure)."""

from __future__ import annotations

from typing import Any

from turbonode.tiers import TIERS

from .netlink import ClassState
from .tree import class_handle, fmt_handle

# HTB counters of a tier: the sum over its classes (its own and its limit class).
SUMMED = {
    "htb_sent_bytes": "bytes",
    "htb_sent_packets": "packets",
    "drops": "drops",
    "backlog_bytes": "backlog_bytes",
    "backlog_packets": "backlog_packets",
    "borrowed": "borrows",
}


def limit_row(c: ClassState | None, until_ns: int, now_ns: int, wall_now: float) -> dict[str, Any]:
    """A tier's leased limit: its class, ceiling, whether the classifier uses it now (the
    lease's deadline lies ahead) and the deadline as wall-clock time (past: lapsed; None: lifted
    or never leased)."""
    return {
        "class": fmt_handle(c.handle) if c else None,
        "ceil_bps": c.ceil_bps if c else None,
        "in_force": c is not None and until_ns > now_ns,
        "until": wall_now + (until_ns - now_ns) / 1e9 if until_ns else None,
        "htb_sent_bytes": c.bytes if c else None,
        "htb_sent_packets": c.packets if c else None,
    }


def tier_rows(
    counters: list[tuple[int, int]],
    classes: list[ClassState],
    dscp_table: list[int],
    limits: list[tuple[int, int]],
    now_ns: int,
    wall_now: float,
) -> dict[str, Any]:
    """{tier: {...}, "unparsed": {...}}: counters indexed by tier index (last slot: unparsed),
    classes as read from the kernel, dscp_table the live DSCP -> tier index map, limits the live
    (until_ns, minor) per tier index, now_ns the classifier's clock (bpf_ktime_get_ns) at
    wall-clock time wall_now. A tier's ceil_bps is the one in force: its limit's while leased."""
    by_handle = {c.handle: c for c in classes}
    rows: dict[str, dict[str, Any]] = {}
    for t in TIERS:
        c = by_handle.get(class_handle(t.class_minor))
        until_ns, minor = limits[t.index] if t.index < len(limits) else (0, 0)
        lc = by_handle.get(class_handle(minor)) if minor else None
        limit = limit_row(lc, until_ns, now_ns, wall_now) if minor else None
        own = [x for x in (c, lc) if x is not None]
        packets, nbytes = counters[t.index] if t.index < len(counters) else (0, 0)
        rows[t.name] = {
            "class": fmt_handle(class_handle(t.class_minor)),
            "dscp": [d for d, idx in enumerate(dscp_table) if idx == t.index],
            "packets": packets,
            "bytes": nbytes,
            "rate_bps": c.rate_bps if c else None,
            "ceil_bps": lc.ceil_bps if lc and limit and limit["in_force"] else c.ceil_bps if c else None,
            "prio": c.prio if c else None,
            **{key: sum(getattr(x, attr) for x in own) if c else None for key, attr in SUMMED.items()},
            "limit": limit,
        }
    packets, nbytes = counters[len(TIERS)] if len(counters) > len(TIERS) else (0, 0)
    rows["unparsed"] = {"packets": packets, "bytes": nbytes}
    return rows
