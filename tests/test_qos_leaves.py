"""Leaf-kind detection in reconcile_leaves. This kernel has no fq_codel, so the real tests only
see the pfifo fallback; a stand-in link reproduces a kernel that has it (and one with neither)."""

import pytest

from tc.netlink import Qdisc, UnsupportedKind
from tc.reconcile import reconcile_leaves
from tc.tree import build_tree
from turbonode.errors import DatapathError


class KernelStandIn:
    def __init__(self, kinds):
        self.kinds = kinds
        self.made = {}

    def qdiscs(self):
        return [Qdisc(kind, handle, parent, limit) for parent, (kind, handle, limit) in self.made.items()]

    def replace_leaf(self, kind, parent, handle, limit):
        if kind not in self.kinds:
            raise UnsupportedKind(kind)
        self.made[parent] = (kind, handle, limit)


@pytest.mark.parametrize("kernel, chosen", [({"fq_codel", "pfifo"}, "fq_codel"), ({"pfifo"}, "pfifo")])
def test_prefers_fq_codel_and_falls_back_to_pfifo(kernel, chosen):
    link, state, tree = KernelStandIn(kernel), {}, build_tree(10**8, leaf_limit=500)
    assert reconcile_leaves(link, tree, state) == 4
    assert state["leaf_kind"] == chosen
    assert {k for k, _, _ in link.made.values()} == {chosen}
    assert {limit for _, _, limit in link.made.values()} == {500}
    assert reconcile_leaves(link, tree, state) == 0  # idempotent


def test_no_usable_leaf_kind_is_an_error():
    with pytest.raises(DatapathError, match="none of the leaf qdiscs fq_codel, pfifo"):
        reconcile_leaves(KernelStandIn(set()), build_tree(10**8), {})
