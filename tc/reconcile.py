"""Declarative reconcile of the HTB tree on one interface: compare, replace what differs,
read back. Touches only what turbonode created, and records the root qdisc it replaced so
`remove` can leave the interface as it was.

What turbonode owns on an interface is recorded in a state file (run_dir/qos/<ns>/<dev>.json),
written before the first change so that a crash half-way still leaves `remove` able to undo it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from turbonode.errors import DatapathError

from .netlink import TC_H_ROOT, ClassState, Link, UnsupportedKind
from .tree import LEAF_KINDS, PROG_PREFIX, ROOT_HANDLE, HtbClass, Tree, fmt_handle


@dataclass(frozen=True)
class Places:
    """Where an interface's pinned maps and state live."""

    pin_dir: str
    state_file: str


def places(dev: str, netns: str | None, bpffs: str = "/sys/fs/bpf", run_dir: str = "/run/turbonode") -> Places:
    ns = netns or "host"
    return Places(os.path.join(bpffs, "turbonode", ns, dev), os.path.join(run_dir, "qos", ns, f"{dev}.json"))


def load_state(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            state: dict[str, Any] = json.load(f)
            return state
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DatapathError(f"unreadable datapath state {path}: {exc}") from None


def save_state(path: str, state: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _same_class(have: ClassState, want: HtbClass) -> bool:
    # The kernel reports a class attached directly to the qdisc with parent TC_H_ROOT.
    parent = ROOT_HANDLE if have.parent == TC_H_ROOT else have.parent
    return (
        parent == want.parent
        and have.rate_bps == want.rate_bps // 8 * 8
        and have.ceil_bps == want.ceil_bps // 8 * 8
        and have.prio == want.prio
        and have.quantum == want.quantum
    )


def owns_root(link: Link, state: dict[str, Any] | None) -> bool:
    """Is the root qdisc turbonode's? Our HTB 1: recorded in the state file, or, when the state
    is gone (a wiped /run), an HTB 1: whose filter carries our name (PROG_PREFIX)."""
    root = link.root_qdisc()
    if root is None or root.kind != "htb" or root.handle != ROOT_HANDLE:
        return False
    return state is not None or any(f.name and f.name.startswith(PROG_PREFIX) for f in link.filters())


def claim_root(link: Link, tree: Tree, state: dict[str, Any] | None, state_file: str) -> dict[str, Any]:
    """Make sure 1: is our HTB; record what it replaces. Returns the (new) state."""
    root = link.root_qdisc()
    ours = owns_root(link, state)
    if not ours and root is not None and root.handle != 0:
        # A handle of 0 means the kernel attached it (noqueue, pfifo_fast, mq...): deleting ours
        # brings it back. Anything else somebody configured; replacing it would lose their setup.
        raise DatapathError(
            f"{link.where} has a root qdisc {root.kind} {fmt_handle(root.handle)} that "
            "turbonode did not create: remove it first (tc qdisc del dev ... root)"
        )
    if state is None:
        # Without a state file our own HTB may already be there: the kernel default comes back
        # when it is deleted, and that default's kind is not known any more.
        previous = None if ours else (root.kind if root else None)
        state = {"dev": link.dev, "netns": link.netns, "previous_root": {"kind": previous, "handle": 0}}
        save_state(state_file, state)
    if not ours or root is None or root.defcls != tree.default_minor:
        link.replace_htb_root(tree.default_minor)
    return state


def reconcile_classes(link: Link, tree: Tree) -> int:
    """Replace classes that differ, delete ours that are no longer wanted. Returns changes."""
    have = {c.handle: c for c in link.classes()}
    changes = 0
    for want in tree.classes:
        if want.handle not in have or not _same_class(have[want.handle], want):
            link.replace_class(want)
            changes += 1
    wanted = {c.handle for c in tree.classes}
    for handle in sorted(set(have) - wanted, key=lambda h: have[h].parent == ROOT_HANDLE):
        link.delete_class(handle)  # leaves before the root class, as HTB requires
        changes += 1
    return changes


def reconcile_leaves(link: Link, tree: Tree, state: dict[str, Any]) -> int:
    """Bounded leaf queues: the first kind in LEAF_KINDS this kernel has (remembered in state)."""
    have = {q.parent: q for q in link.qdiscs()}
    kinds = [state["leaf_kind"]] if state.get("leaf_kind") else list(LEAF_KINDS)
    changes = 0
    for leaf in tree.leaves:
        q = have.get(leaf.parent)
        if q and q.handle == leaf.handle and q.kind in kinds and q.limit == leaf.limit:
            continue
        for kind in list(kinds):
            try:
                link.replace_leaf(kind, leaf.parent, leaf.handle, leaf.limit)
            except UnsupportedKind:
                kinds.remove(kind)
                continue
            kinds = [kind]
            break
        else:
            raise DatapathError(f"none of the leaf qdiscs {', '.join(LEAF_KINDS)} exists in this kernel")
        changes += 1
    state["leaf_kind"] = kinds[0]
    return changes


def read_back(link: Link, tree: Tree, prog_name: str) -> None:
    """Verify the kernel holds exactly the tree we asked for and one classifier filter."""
    have = {c.handle: c for c in link.classes()}
    for want in tree.classes:
        got = have.get(want.handle)
        if got is None or not _same_class(got, want):
            raise DatapathError(
                f"read-back: class {fmt_handle(want.handle)} on {link.where} is {got}, "
                f"wanted rate {want.rate_bps} ceil {want.ceil_bps} prio {want.prio}"
            )
    filters = link.filters()
    ours = [f for f in filters if f.kind == "bpf" and f.name == prog_name]
    if len(ours) != 1 or len(filters) != 1:
        raise DatapathError(f"read-back: expected one classifier filter on {link.where}, found {filters}")
    if not ours[0].direct_action or ours[0].classid != ROOT_HANDLE:
        raise DatapathError(f"read-back: classifier filter on {link.where} is not direct-action on 1:")


def remove(link: Link, state: dict[str, Any] | None, where: Places) -> dict[str, Any]:
    """Delete our root (and with it every class, leaf and filter), unpin the maps, forget state."""
    removed = False
    if owns_root(link, state):
        link.delete_root()
        removed = True
    shutil.rmtree(where.pin_dir, ignore_errors=True)
    try:
        os.remove(where.state_file)
    except FileNotFoundError:
        pass
    for d in (os.path.dirname(where.pin_dir), os.path.dirname(where.state_file)):
        try:
            os.rmdir(d)  # the per-namespace directory, once its last interface is gone
        except OSError:
            pass
    now = link.root_qdisc()
    previous = (state or {}).get("previous_root", {}).get("kind")
    return {
        "removed": removed,
        "root": now.kind if now else None,
        "previous_root": previous,
        "restored": previous is None or (now is not None and now.kind == previous),
    }
