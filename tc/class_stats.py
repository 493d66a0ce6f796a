"""Per-tier view of the datapath: BPF counters next to the HTB class statistics (pure)."""

from __future__ import annotations

from typing import Any

from turbonode.tiers import TIERS

from .netlink import ClassState
from .tree import class_handle, fmt_handle


def tier_rows(counters: list[tuple[int, int]], classes: list[ClassState], dscp_table: list[int]) -> dict[str, Any]:
    """{tier: {...}, "unparsed": {...}}: counters indexed by tier index (last slot: unparsed),
    classes as read from the kernel, dscp_table the live DSCP -> tier index map."""
    by_handle = {c.handle: c for c in classes}
    rows: dict[str, dict[str, Any]] = {}
    for t in TIERS:
        c = by_handle.get(class_handle(t.class_minor))
        packets, nbytes = counters[t.index] if t.index < len(counters) else (0, 0)
        rows[t.name] = {
            "class": fmt_handle(class_handle(t.class_minor)),
            "dscp": [d for d, idx in enumerate(dscp_table) if idx == t.index],
            "packets": packets,
            "bytes": nbytes,
            "rate_bps": c.rate_bps if c else None,
            "ceil_bps": c.ceil_bps if c else None,
            "prio": c.prio if c else None,
            "htb_sent_bytes": c.bytes if c else None,
            "htb_sent_packets": c.packets if c else None,
            "drops": c.drops if c else None,
            "backlog_bytes": c.backlog_bytes if c else None,
            "backlog_packets": c.backlog_packets if c else None,
            "borrowed": c.borrows if c else None,
        }
    packets, nbytes = counters[len(TIERS)] if len(counters) > len(TIERS) else (0, 0)
    rows["unparsed"] = {"packets": packets, "bytes": nbytes}
    return rows
