"""Pure model of the HTB tree turbonode wants on an interface (no I/O).

    1: htb default 1:<other>
    └─ 1:1 root class, rate = ceil = link
       ├─ 1:10 turbo  prio 0  ├─ 1:20 fast  prio 1  ├─ 1:30 other prio 2  ├─ 1:40 relax prio 3
       └─ 1:41 relax's limit class, prio 3: its lowered ceiling, used only while leased (docs/qos.md)
       each with a bounded leaf qdisc <minor>:0 (fq_codel where the kernel has it, else pfifo)

Rates are bits per second in the model and bytes per second on the wire (HTB's unit).
"""

from __future__ import annotations

from dataclasses import dataclass

from turbonode.qos_params import check_leaf_limit, check_link_rate, check_rate, check_shares
from turbonode.rates import format_rate
from turbonode.tiers import BY_NAME, DEFAULT_TIER, TIERS, Tier, full_dscp_map

ROOT_HANDLE = 0x10000  # qdisc 1:
ROOT_CLASS = 0x10001  # class 1:1
FILTER_PRIO = 1
FILTER_HANDLE = 1
PROG_PREFIX = "turbonode_"  # TCA_BPF_NAME prefix of our classifier filter (trees of earlier versions)
# The mark of turbonode's root: r2q (rate to quantum divisor) of our `htb 1:`, set in the message
# that creates it and read back from the kernel (docs/qos.md, "Ownership"). Every class turbonode
# makes sets its quantum, so r2q changes nothing of ours; nobody sets 29794 ("tb") by chance.
OWNER_R2Q = 0x7462
MTU = 1514  # Ethernet frame without FCS
HTB_QUANTUM_MIN = 1000  # HTB warns "quantum is small" below this
HTB_QUANTUM_MAX = 200000  # ... and "quantum is big" above
BURST_TIME_S = 0.001  # token bucket depth: 1 ms at the class's rate (tc's default at HZ=1000)
LEAF_KINDS = ("fq_codel", "pfifo")  # preference order; the kernel decides which exists


def class_handle(minor: int) -> int:
    return ROOT_HANDLE | minor


def leaf_handle(minor: int) -> int:
    """The leaf qdisc under class 1:<minor> gets handle <minor>:0."""
    return minor << 16


def fmt_handle(handle: int) -> str:
    return f"{handle >> 16:x}:{handle & 0xFFFF:x}"


@dataclass(frozen=True)
class HtbClass:
    tier: str | None  # None for the root class 1:1
    minor: int
    parent: int  # parent class handle (1:1) or the qdisc handle (1:) for the root class
    rate_bps: int
    ceil_bps: int
    prio: int
    burst: int  # bytes
    cburst: int  # bytes
    quantum: int  # bytes

    @property
    def handle(self) -> int:
        return class_handle(self.minor)


@dataclass(frozen=True)
class Leaf:
    tier: str
    parent: int  # class handle
    handle: int
    limit: int  # packets


@dataclass(frozen=True)
class Tree:
    rate_bps: int
    default_minor: int
    classes: tuple[HtbClass, ...]
    leaves: tuple[Leaf, ...]
    dscp_table: tuple[int, ...]  # 64 entries: DSCP -> tier index
    tier_minors: tuple[int, ...]  # tier index -> class minor
    limit_minors: tuple[int, ...]  # tier index -> minor of its limit class (0: none)

    def tier_class(self, name: str) -> HtbClass:
        """The tier's own class (not its limit class)."""
        minor = BY_NAME[name].class_minor
        for c in self.classes:
            if c.minor == minor:
                return c
        raise KeyError(name)


def class_minors(t: Tier) -> tuple[int, ...]:
    """The minors of the classes tier `t` has: its own, and its limit class if any."""
    return (t.class_minor, t.limit_minor) if t.limit_minor else (t.class_minor,)


def tier_leaves(limit: int) -> tuple[Leaf, ...]:
    """One bounded leaf queue <minor>: under each tier's class 1:<minor> (limit classes included)."""
    return tuple(Leaf(t.name, class_handle(m), leaf_handle(m), limit) for t in TIERS for m in class_minors(t))


def burst_bytes(rate_bps: int) -> int:
    """Token bucket depth: BURST_TIME_S at `rate`, never less than two full frames."""
    return max(int(rate_bps / 8 * BURST_TIME_S), 2 * MTU)


def quantum_bytes(rate_bps: int) -> int:
    """DRR quantum sized from the rate (rate/r2q with r2q=10) but clamped so HTB never warns
    and a quantum always covers a full frame."""
    return min(max(rate_bps // 8 // 10, MTU, HTB_QUANTUM_MIN), HTB_QUANTUM_MAX)


def htb_class(tier: str | None, minor: int, parent: int, rate_bps: int, ceil_bps: int, prio: int) -> HtbClass:
    return HtbClass(
        tier,
        minor,
        parent,
        rate_bps,
        ceil_bps,
        prio,
        burst_bytes(rate_bps),
        burst_bytes(ceil_bps),
        quantum_bytes(rate_bps),
    )


def build_tree(
    rate_bps: int,
    rate_pct: dict[str, int] | None = None,
    ceil_pct: dict[str, int] | None = None,
    leaf_limit: int = 1000,
    dscp: dict[int, str] | None = None,
) -> Tree:
    """The desired tree for a link of `rate_bps`, tier shares from the tier table with
    per-tier percent overrides. Raises ValueError naming the bad value (turbonode.qos_params:
    the checks `config check` runs)."""
    check_link_rate(rate_bps)
    try:
        check_leaf_limit(leaf_limit)
    except ValueError as exc:
        raise ValueError(f"leaf_limit {exc}") from None
    rate_pct, ceil_pct = check_shares(rate_pct, ceil_pct)
    classes = [htb_class(None, 1, ROOT_HANDLE, rate_bps, rate_bps, 0)]
    for t in TIERS:
        rate = rate_bps * rate_pct[t.name] // 100
        ceil = rate_bps * ceil_pct[t.name] // 100
        # A limit class starts as its tier's twin: nothing is lowered until the agent leases a limit.
        classes += [htb_class(t.name, m, ROOT_CLASS, rate, ceil, t.prio) for m in class_minors(t)]
    return Tree(
        rate_bps=rate_bps,
        default_minor=BY_NAME[DEFAULT_TIER].class_minor,
        classes=tuple(classes),
        leaves=tier_leaves(leaf_limit),
        dscp_table=tuple(full_dscp_map(dscp)),
        tier_minors=tuple(t.class_minor for t in sorted(TIERS, key=lambda t: t.index)),
        limit_minors=tuple(t.limit_minor for t in sorted(TIERS, key=lambda t: t.index)),
    )


def with_rate(old: HtbClass, link_bps: int, rate_bps: int, ceil_bps: int | None = None) -> HtbClass:
    """Tier class `old` with a new rate/ceil (ceil defaults to the current one, at least rate)
    on a link of `link_bps`."""
    ceil = max(ceil_bps if ceil_bps is not None else old.ceil_bps, rate_bps)
    check_rate(rate_bps)
    if ceil > link_bps:
        raise ValueError(f"ceil {format_rate(ceil)} exceeds the link rate {format_rate(link_bps)}")
    if ceil_bps is not None and ceil_bps < rate_bps:
        raise ValueError(f"ceil {format_rate(ceil_bps)} is below rate {format_rate(rate_bps)}")
    return htb_class(old.tier, old.minor, old.parent, rate_bps, ceil, old.prio)
