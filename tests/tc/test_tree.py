"""The HTB tree model: pure, no kernel."""

import pytest

from tc.tree import (
    HTB_QUANTUM_MAX,
    HTB_QUANTUM_MIN,
    MTU,
    ROOT_CLASS,
    ROOT_HANDLE,
    build_tree,
    fmt_handle,
    leaf_handle,
    with_rate,
)
from turbonode.tiers import TIERS


def test_default_tree_follows_the_tier_table():
    tree = build_tree(100_000_000)
    root, *tiers = tree.classes
    assert (root.handle, root.parent, root.rate_bps, root.ceil_bps) == (ROOT_CLASS, ROOT_HANDLE, 10**8, 10**8)
    assert [(c.tier, fmt_handle(c.handle), c.prio, c.rate_bps, c.ceil_bps) for c in tiers] == [
        ("turbo", "1:10", 0, 90_000_000, 100_000_000),  # turbo first (docs/design.md, tiers)
        ("fast", "1:20", 1, 5_000_000, 100_000_000),
        ("other", "1:30", 2, 3_000_000, 100_000_000),
        ("relax", "1:40", 3, 2_000_000, 100_000_000),
        # relax's limit class: its twin until the agent leases a lowered ceiling (docs/qos.md)
        ("relax", "1:41", 3, 2_000_000, 100_000_000),
    ]
    assert all(c.parent == ROOT_CLASS for c in tiers)
    assert tree.default_minor == 0x30
    assert [(fmt_handle(leaf.parent), fmt_handle(leaf.handle), leaf.limit) for leaf in tree.leaves] == [
        ("1:10", "10:0", 1000),
        ("1:20", "20:0", 1000),
        ("1:30", "30:0", 1000),
        ("1:40", "40:0", 1000),
        ("1:41", "41:0", 1000),
    ]
    assert tree.tier_minors == (0x10, 0x20, 0x30, 0x40)
    assert tree.limit_minors == (0, 0, 0, 0x41)


def test_dscp_table_defaults_and_overrides():
    tree = build_tree(10**9, dscp={10: "fast", 46: "relax"})
    assert len(tree.dscp_table) == 64
    assert tree.dscp_table[34] == 1 and tree.dscp_table[8] == 3 and tree.dscp_table[0] == 2
    assert tree.dscp_table[10] == 1 and tree.dscp_table[46] == 3


@pytest.mark.parametrize("rate", [64_000, 1_000_000, 100_000_000, 10**9, 10 * 10**9, 100 * 10**9])
def test_quantum_and_burst_never_make_htb_warn(rate):
    for c in build_tree(rate).classes:
        assert HTB_QUANTUM_MIN <= c.quantum <= HTB_QUANTUM_MAX and c.quantum >= MTU
        assert c.burst >= 2 * MTU and c.cburst >= 2 * MTU
        assert c.burst >= c.rate_bps / 8 / 1000  # at least 1 ms of tokens


def test_overrides_and_their_errors():
    tree = build_tree(10**8, rate_pct={"turbo": 85, "fast": 5, "other": 5, "relax": 5}, ceil_pct={"relax": 50})
    assert tree.tier_class("turbo").rate_bps == 85_000_000
    assert tree.tier_class("relax").ceil_bps == 50_000_000
    assert tree.tier_class("relax").minor == 0x40  # its own class, not the limit class 1:41
    with pytest.raises(ValueError, match="rate_pct: guaranteed shares add up to 120 %"):
        build_tree(10**8, rate_pct={"fast": 25})
    with pytest.raises(ValueError, match=r"ceil_pct: relax: 1 % is below its rate_pct \(2 %\)"):
        build_tree(10**8, ceil_pct={"relax": 1})
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        build_tree(10**8, rate_pct={"gold": 1})
    with pytest.raises(ValueError, match="link rate 0bit is out of range: must be between 64kbit and 10tbit"):
        build_tree(0)
    with pytest.raises(ValueError, match="ceil_pct: fast: must be a percent 1..100, got 200"):
        build_tree(10**8, ceil_pct={"fast": 200})


def test_with_rate():
    tree = build_tree(10**8)
    relax = tree.tier_class("relax")
    c = with_rate(relax, tree.rate_bps, 5_000_000, 20_000_000)
    assert (c.tier, c.minor, c.prio, c.rate_bps, c.ceil_bps) == ("relax", 0x40, 3, 5_000_000, 20_000_000)
    assert with_rate(relax, tree.rate_bps, 5_000_000).ceil_bps == 100_000_000  # ceil kept
    with pytest.raises(ValueError, match="exceeds the link rate 100mbit"):
        with_rate(relax, tree.rate_bps, 5_000_000, 200_000_000)
    with pytest.raises(ValueError, match="below rate"):
        with_rate(relax, tree.rate_bps, 5_000_000, 1_000_000)


def test_leaf_handles_do_not_collide_with_the_root():
    assert {leaf_handle(t.class_minor) for t in TIERS}.isdisjoint({ROOT_HANDLE})
