"""Declarative reconcile of the HTB tree on one interface, from what the kernel holds.

Nothing is remembered between runs: whether the root is ours, which leaf kind the kernel has
and which program is attached are read back from the kernel every time, so a wiped /run, a
killed apply or a root somebody else created cannot mislead apply or remove.

Ownership (docs/qos.md): turbonode creates its `htb 1:` with r2q = OWNER_R2Q in the very
message that creates it, so there is no moment at which our root lacks its mark; trees made by
earlier versions are recognised by the classifier filter's name (PROG_PREFIX). A root with
neither is somebody else's: apply refuses it and remove leaves it alone. Roots the kernel
attached itself (handle 0: noqueue, pfifo_fast, mq, ...) come back when ours is deleted.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

from turbonode.errors import DatapathError

from .netlink import TC_H_ROOT, ClassState, FilterState, Link, Qdisc, UnsupportedKind, root_of
from .tree import (
    FILTER_HANDLE,
    FILTER_PRIO,
    LEAF_KINDS,
    OWNER_R2Q,
    PROG_PREFIX,
    ROOT_HANDLE,
    HtbClass,
    Leaf,
    Tree,
    fmt_handle,
)

HOST = "host"  # the directory name for the process's own network namespace
LOCK_SUFFIX = ".lock"
NETNS_DIR = "/run/netns"


@dataclass(frozen=True)
class Places:
    """Where an interface's pinned maps and its ownership lock live."""

    pin_dir: str
    lock_file: str


def places(dev: str, netns: str | None, bpffs: str = "/sys/fs/bpf", run_dir: str = "/run/turbonode") -> Places:
    ns = netns or HOST
    return Places(os.path.join(bpffs, "turbonode", ns, dev), os.path.join(run_dir, "qos", ns, dev + LOCK_SUFFIX))


# ---- ownership ------------------------------------------------------------------------


def root_owner(root: Qdisc | None, filters: Iterable[FilterState]) -> str:
    """'ours', 'default' (none, or one the kernel attached: handle 0) or 'foreign'."""
    if root is None or root.handle == 0:
        return "default"
    if root.kind == "htb" and root.handle == ROOT_HANDLE:
        if root.r2q == OWNER_R2Q or any(f.name and f.name.startswith(PROG_PREFIX) for f in filters):
            return "ours"
    return "foreign"


def read_owner(link: Link) -> tuple[Qdisc | None, str]:
    root, owner, _ = owner_of(link, link.qdiscs())
    return root, owner


def owner_of(link: Link, qdiscs: Iterable[Qdisc]) -> tuple[Qdisc | None, str, list[FilterState]]:
    """read_owner from the link's qdiscs as already dumped, with the filters on our root (none on
    another's): a reader that wants both dumps each once."""
    root = root_of(qdiscs)
    filters = link.filters() if root is not None and root.handle == ROOT_HANDLE else []
    return root, root_owner(root, filters), filters


def claim_root(link: Link, tree: Tree) -> int:
    """Make sure 1: is our HTB with the tree's default class. Returns the number of changes."""
    root, owner = read_owner(link)
    if owner == "foreign":
        assert root is not None
        raise DatapathError(
            f"{link.where} has a root qdisc {root.kind} {fmt_handle(root.handle)} that turbonode did not create: "
            "remove it first (tc qdisc del dev ... root)"
        )
    if owner == "ours":
        assert root is not None
        if root.defcls == tree.default_minor:
            return 0
        link.delete_root()  # HTB has no change operation: our own root is made again
    link.replace_htb_root(tree.default_minor)
    return 1


# ---- classes and leaves ---------------------------------------------------------------


def _same_class(have: ClassState, want: HtbClass) -> bool:
    # The kernel reports a class attached directly to the qdisc with parent TC_H_ROOT.
    parent = ROOT_HANDLE if have.parent == TC_H_ROOT else have.parent
    # HTB sets a class's quantum only while it is a leaf (htb_change_class: `if (!cl->level)`):
    # the root class 1:1 keeps the one it was created with, whatever link rate a later apply sets.
    inner = want.tier is None
    return (
        parent == want.parent
        and have.rate_bps == want.rate_bps // 8 * 8
        and have.ceil_bps == want.ceil_bps // 8 * 8
        and have.prio == want.prio
        and (inner or have.quantum == want.quantum)
    )


def tree_classes(classes: Iterable[ClassState]) -> dict[int, ClassState]:
    """The classes of the qdisc 1: (a leaf qdisc's own classes go with the leaf)."""
    return {c.handle: c for c in classes if c.handle >> 16 == ROOT_HANDLE >> 16}


def class_changes(have: dict[int, ClassState], tree: Tree) -> tuple[list[HtbClass], list[int]]:
    """(classes to replace, parents first; handles of classes the tree lacks, children first)."""
    replace = [w for w in tree.classes if w.handle not in have or not _same_class(have[w.handle], w)]

    def depth(handle: int) -> int:
        d, parent = 0, have[handle].parent
        while parent in have and d < len(have):  # bounded: a parent loop cannot hang us
            d, parent = d + 1, have[parent].parent
        return d

    extra = sorted(set(have) - {c.handle for c in tree.classes}, key=lambda h: (-depth(h), h))
    return replace, extra


def reconcile_classes(link: Link, tree: Tree) -> tuple[int, list[str]]:
    """Delete classes the tree does not have (added by hand, or from an older tree: children
    first, as HTB requires), then replace ours that differ. Returns (changes, deleted handles)."""
    replace, extra = class_changes(tree_classes(link.classes()), tree)
    for handle in extra:
        link.delete_class(handle)
    for want in replace:
        link.replace_class(want)
    return len(extra) + len(replace), [fmt_handle(h) for h in sorted(extra)]


def our_leaves(have: dict[int, Qdisc], leaves: Iterable[Leaf]) -> list[Qdisc]:
    """The qdiscs the kernel holds at our leaves' places, with our handles and a kind we make."""
    return [
        q
        for leaf in leaves
        if (q := have.get(leaf.parent)) is not None and q.handle == leaf.handle and q.kind in LEAF_KINDS
    ]


def leaf_kinds(have: dict[int, Qdisc], leaves: Iterable[Leaf]) -> list[str]:
    """LEAF_KINDS, those the kernel already holds under our classes first: the leaves stay of
    one kind, and a kernel without fq_codel is not asked for it on every apply."""
    present = {q.kind for q in our_leaves(have, leaves)}
    return sorted(LEAF_KINDS, key=lambda k: (k not in present, LEAF_KINDS.index(k)))


def leaf_current(q: Qdisc | None, leaf: Leaf, kind: str) -> bool:
    return q is not None and q.handle == leaf.handle and q.kind == kind and q.limit == leaf.limit


def reconcile_leaves(link: Link, tree: Tree) -> int:
    """Bounded leaf queues of one kind (the kernel's, or the first of LEAF_KINDS it accepts)."""
    have = {q.parent: q for q in link.qdiscs()}
    kinds = leaf_kinds(have, tree.leaves)
    changes = 0
    for leaf in tree.leaves:
        q = have.get(leaf.parent)
        if leaf_current(q, leaf, kinds[0]):
            continue
        if q is not None and q.handle == leaf.handle and q.kind != kinds[0]:
            link.delete_leaf(leaf.parent, leaf.handle)  # a qdisc cannot change its kind in place (EINVAL)
        while True:
            try:
                link.replace_leaf(kinds[0], leaf.parent, leaf.handle, leaf.limit)
                break
            except UnsupportedKind:
                kinds.pop(0)
                if not kinds:
                    raise DatapathError(
                        f"none of the leaf qdiscs {', '.join(LEAF_KINDS)} exists in this kernel"
                    ) from None
        changes += 1
    return changes


def leaf_kind(qdiscs: Iterable[Qdisc], leaves: Iterable[Leaf]) -> str | None:
    """The kind of the leaf queues the kernel holds under our classes ("a,b" if mixed)."""
    kinds = {q.kind for q in our_leaves({q.parent: q for q in qdiscs}, leaves)}
    return ",".join(sorted(kinds)) or None


# ---- filters ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtraFilter:
    """A filter on 1: that is not our classifier: one beside it in its prio (handle), or a
    whole prio of a chain (handle 0: u32 alone makes several entries, its hash tables)."""

    kind: str
    chain: int
    prio: int
    handle: int

    def __str__(self) -> str:
        handle = f" handle {self.handle:#x}" if self.handle else ""
        chain = f" chain {self.chain}" if self.chain else ""
        return f"{self.kind} pref {self.prio}{handle}{chain}"


def is_classifier(f: FilterState) -> bool:
    """The place of our classifier filter (whatever program it holds: apply replaces it)."""
    return f.kind == "bpf" and (f.chain, f.prio, f.handle) == (0, FILTER_PRIO, FILTER_HANDLE)


def extra_filters(filters: Iterable[FilterState]) -> list[ExtraFilter]:
    """What apply deletes from 1: (the tree under it is turbonode's, filters like classes),
    in chain, prio, handle order."""
    filters = list(filters)
    ours = {(f.chain, f.prio) for f in filters if is_classifier(f)}
    extra = {
        ExtraFilter(f.kind, f.chain, f.prio, f.handle if (f.chain, f.prio) in ours else 0)
        for f in filters
        if not is_classifier(f)
    }
    return sorted(extra, key=lambda e: (e.chain, e.prio, e.handle))


def reconcile_filters(link: Link) -> list[str]:
    """Delete the filters on 1: that are not our classifier; returns them, described."""
    extra = extra_filters(link.filters())
    for e in extra:
        link.delete_filters(e.chain, e.prio, e.handle)
    return [str(e) for e in extra]


# ---- read back --------------------------------------------------------------------------


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
    qdiscs = link.qdiscs()
    found = our_leaves({q.parent: q for q in qdiscs}, tree.leaves)
    if len(found) != len(tree.leaves) or len({q.kind for q in found}) != 1:
        raise DatapathError(f"read-back: leaf queues on {link.where} are not one kind under every tier: {qdiscs}")
    filters = link.filters()
    ours = [f for f in filters if is_classifier(f) and f.name == prog_name]
    if len(ours) != 1 or len(filters) != 1:
        seen = [f"bpf pref {FILTER_PRIO} {f.name}" for f in filters if is_classifier(f)]
        seen += [str(e) for e in extra_filters(filters)]
        raise DatapathError(
            f"read-back: expected only the classifier filter {prog_name} on {link.where}, found: "
            f"{', '.join(seen) or 'none'} (another process changed them meanwhile? apply again)"
        )
    if not ours[0].direct_action or ours[0].classid != ROOT_HANDLE:
        raise DatapathError(f"read-back: classifier filter on {link.where} is not direct-action on 1:")


# ---- what stays behind ------------------------------------------------------------------


def forget(where: Places) -> bool:
    """Unpin the maps; drop the per-namespace pin directory once empty. Returns whether there
    were pins. (The lock file goes when its holder releases it: turbonode.locks.)"""
    found = os.path.isdir(where.pin_dir)
    shutil.rmtree(where.pin_dir, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(where.pin_dir))  # the namespace's directory, once its last interface is gone
    except OSError:
        pass
    return found


def entries(bpffs: str, run_dir: str) -> set[tuple[str, str]]:
    """(netns dir name, device) of every interface with pins or a lock file."""
    found: set[tuple[str, str]] = set()
    for base, suffix in ((os.path.join(bpffs, "turbonode"), ""), (os.path.join(run_dir, "qos"), LOCK_SUFFIX)):
        try:
            namespaces = os.listdir(base)
        except OSError:
            continue
        for ns in namespaces:
            try:
                names = os.listdir(os.path.join(base, ns))
            except OSError:
                continue
            found |= {(ns, n.removesuffix(suffix)) for n in names if n.endswith(suffix)}
    return found


def stale(found: Iterable[tuple[str, str]], netns: str | None, devices: set[str]) -> list[tuple[str, str]]:
    """Entries whose named namespace is gone, or whose device is gone from `netns` (whose
    devices are `devices`). Entries of the process's own namespace ("host") are never guessed
    at: one process's host is another's netns (`ip netns exec`); `remove` cleans those."""
    return sorted(
        (ns, dev)
        for ns, dev in found
        if ns != HOST and (not os.path.exists(os.path.join(NETNS_DIR, ns)) or (ns == netns and dev not in devices))
    )


def remove(link: Link, where: Places) -> dict[str, object]:
    """Delete our root (and with it every class, leaf and filter) and unpin the maps. The
    kernel puts the interface's default root qdisc back."""
    _, owner = read_owner(link)
    if owner == "ours":
        link.delete_root()
    now = link.root_qdisc()
    forget(where)
    return {
        "removed": owner == "ours",
        "root": now.kind if now else None,
        "restored": now is None or now.handle == 0,
        "stale": [],
    }
