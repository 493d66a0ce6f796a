"""Leaf-kind detection in reconcile_leaves. This kernel has no fq_codel, so the real tests only
see the pfifo fallback; a stand-in link reproduces a kernel that has it (and one with neither)."""

import pytest

from tc.netlink import Qdisc, UnsupportedKind
from tc.reconcile import leaf_kind, reconcile_leaves
from tc.tree import build_tree
from turbonode.errors import DatapathError


class KernelStandIn:
    """Leaf qdiscs by parent; like the kernel, a qdisc cannot change its kind in place."""

    def __init__(self, kinds):
        self.kinds = kinds
        self.made = {}
        self.deleted = 0

    def qdiscs(self):
        return [Qdisc(kind, handle, parent, limit) for parent, (kind, handle, limit) in self.made.items()]

    def replace_leaf(self, kind, parent, handle, limit):
        if kind not in self.kinds:
            raise UnsupportedKind(kind)
        old = self.made.get(parent)
        if old and old[1] == handle and old[0] != kind:
            raise DatapathError("Invalid argument")
        self.made[parent] = (kind, handle, limit)

    def delete_leaf(self, parent, handle):
        del self.made[parent]
        self.deleted += 1


@pytest.mark.parametrize("kernel, chosen", [({"fq_codel", "pfifo"}, "fq_codel"), ({"pfifo"}, "pfifo")])
def test_prefers_fq_codel_and_falls_back_to_pfifo(kernel, chosen):
    link, tree = KernelStandIn(kernel), build_tree(10**8, leaf_limit=500)
    assert reconcile_leaves(link, tree) == 5  # four tiers and relax's limit class
    assert leaf_kind(link.qdiscs(), tree.leaves) == chosen
    assert {k for k, _, _ in link.made.values()} == {chosen}
    assert {limit for _, _, limit in link.made.values()} == {500}
    assert reconcile_leaves(link, tree) == 0  # idempotent


def test_the_kind_the_kernel_holds_is_kept_and_made_whole():
    """pfifo leaves made while fq_codel was missing stay pfifo once it appears (no churn); mixed
    leaves become the preferred kind present, through a delete: the kernel cannot change a kind."""
    link, tree = KernelStandIn({"pfifo"}), build_tree(10**8)
    reconcile_leaves(link, tree)
    link.kinds = {"fq_codel", "pfifo"}
    assert reconcile_leaves(link, tree) == 0 and leaf_kind(link.qdiscs(), tree.leaves) == "pfifo"
    leaf = tree.leaves[0]
    link.made[leaf.parent] = ("fq_codel", leaf.handle, leaf.limit)
    assert leaf_kind(link.qdiscs(), tree.leaves) == "fq_codel,pfifo"
    assert reconcile_leaves(link, tree) == 4 and link.deleted == 4
    assert leaf_kind(link.qdiscs(), tree.leaves) == "fq_codel"


def test_no_usable_leaf_kind_is_an_error():
    with pytest.raises(DatapathError, match="none of the leaf qdiscs fq_codel, pfifo"):
        reconcile_leaves(KernelStandIn(set()), build_tree(10**8))
