"""The QoS datapath of one interface: the API the agent and `turboctl qos` use.

    dp = Datapath("eth0", netns=None)
    dp.apply(qos_config)          # declarative: same config twice changes nothing
    dp.plan(qos_config)           # what apply would change; changes nothing (the agent's dry-run)
    dp.show()                     # {tier: {packets, bytes, htb_sent_bytes, drops, backlog_*, borrowed, ...}}
    dp.set_map({46: "turbo"})     # live DSCP -> tier change, no reload
    dp.set_rate("relax", 5_000_000, 100_000_000)   # live class change, no reload
    dp.limit("relax", 20_000_000, 3.0)  # relax's ceiling lowered for 3 s (its limit class 1:41)
    dp.renew("relax", 3.0)        # ... for 3 s from now; lapses in the kernel unless renewed
    dp.remove()                   # restores the interface's default root qdisc
    dp.hold()                     # own the device until close(): other processes' changes are refused

Everything is read back from the kernel (tc/reconcile.py); nothing is remembered in files. The
datapath lives on in the kernel when the process exits. Changes take the device's lock
(turbonode.locks, <run_dir>/qos/<netns>/<dev>.lock): another process's change waits for the
one in progress, and is refused while an agent holds the device. A Datapath object keeps one
rtnetlink socket open for its frequent calls (show, set_map, set_rate: opening one inside a
namespace forks, ~25 ms); close() or `with` releases it and the hold. Calls on one object
serialise on a lock.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from turbonode import caps
from turbonode.config import QosConfig
from turbonode.errors import BpfUnavailableError, DatapathError, NoDeviceError, TurbonodeError
from turbonode.locks import AGENT_ROLE, FileLock, LockHeld
from turbonode.rates import format_rate, parse_rate
from turbonode.throttle_params import check_ttl
from turbonode.tiers import Tier
from turbonode.tiers import tier as tier_by_name

from . import bpfobj, classifier, reconcile
from .class_stats import tier_rows
from .netlink import ClassState, Link, require_net_admin, require_netns_entry
from .tree import ROOT_CLASS, Tree, build_tree, class_handle, fmt_handle, htb_class, tier_leaves, with_rate

log = logging.getLogger("turbonode.qos")

CHANGE_ROLE = "qos "  # prefix of a single change's role: "qos apply", "qos remove", ...
LOCK_WAIT_S = 90.0  # another process's single change (a compile on a loaded node included) ends within this


def _passing(role: str) -> bool:
    """Is a holder's hold worth waiting for: a single change, or one that has not written its
    role yet (never an agent's)?"""
    return role == "" or role.startswith(CHANGE_ROLE)


class Datapath:
    def __init__(
        self, dev: str, netns: str | None = None, *, bpffs: str = "/sys/fs/bpf", run_dir: str = "/run/turbonode"
    ):
        if not dev:
            raise DatapathError("no device given")
        self.dev = dev
        self.netns = netns or None
        self.places = reconcile.places(dev, self.netns, bpffs, run_dir)
        self._bpffs, self._run_dir = bpffs, run_dir
        self._cached: Link | None = None
        self._lock = threading.RLock()
        self._owner = FileLock(self.places.lock_file, remove_dir=True)
        self._holding = False

    def close(self) -> None:
        """Close the kept-open link and let go of the device if this object held it."""
        with self._lock:
            self._drop_link()
            if self._holding:
                self._owner.release()
                self._holding = False

    def __enter__(self) -> Datapath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop_link(self) -> None:
        if self._cached is not None:
            self._cached.close()
            self._cached = None

    @contextmanager
    def _link(self) -> Iterator[Link]:
        """The kept-open link; dropped on error so that the next call opens a fresh one (the
        device may have been re-created with a new index)."""
        with self._lock:
            if self._cached is None:
                self._cached = Link(self.dev, self.netns)
            try:
                yield self._cached
            except DatapathError:
                self._drop_link()
                raise

    def _where(self) -> str:
        return f"{self.dev} in netns {self.netns}" if self.netns else self.dev

    # ---- ownership --------------------------------------------------------------------

    def _refusal(self, pid: int | None, role: str) -> str:
        who = f"pid {pid}" if pid else "another process"
        if role.startswith(CHANGE_ROLE):
            return f"{self._where()} is busy: {who} has been running `{role}` on it for {LOCK_WAIT_S:.0f} s"
        return (
            f"{self._where()} is managed by a running turbonode {role or 'process'} ({who}): "
            "stop it first, or change QoS through its configuration"
        )

    def _take(self, role: str, wait_s: float) -> None:
        try:
            self._owner.acquire(role, self._refusal, wait_s, wait_for=_passing)
        except LockHeld as exc:
            raise DatapathError(str(exc)) from None

    def hold(self, role: str = AGENT_ROLE) -> None:
        """Own the device until close() (the agent): others' changes are refused meanwhile.
        Raises DatapathError naming the holder if another process holds it."""
        with self._lock:
            if not self._holding:
                require_net_admin(f"tc on {self._where()}")
                self._take(role, 0.0)
                self._holding = True

    @contextmanager
    def _changing(self, op: str) -> Iterator[None]:
        """The device's lock for one change, unless this object holds the device already."""
        with self._lock:
            if self._holding:
                yield
                return
            require_net_admin(f"tc on {self._where()}")  # the first thing a change lacks, named
            self._take(CHANGE_ROLE + op, LOCK_WAIT_S)
            try:
                yield
            finally:
                self._owner.release()

    def require_caps(self) -> None:
        """Name what apply lacks before anything changes: CAP_NET_ADMIN for tc, CAP_SYS_ADMIN to
        enter a named netns, CAP_BPF and CAP_PERFMON for the classifier (the agent calls this
        before it touches the node; bcc would only say "Permission denied")."""
        require_net_admin(f"tc on {self._where()}")
        require_netns_entry(self.netns)
        missing = caps.missing_bpf_and_perfmon()
        if missing:
            raise BpfUnavailableError(caps.lacks(missing, f"loading the classifier on {self._where()}"))

    def _require_ours(self, link: Link) -> None:
        self._check_ours(reconcile.read_owner(link)[1])

    def _check_ours(self, owner: str) -> None:
        if owner != "ours":
            raise DatapathError(f"no turbonode QoS on {self._where()}: run `turboctl qos apply` first")

    # ---- inputs ---------------------------------------------------------------------

    @staticmethod
    def inputs(config: QosConfig | None = None, rate_bps: int | None = None) -> dict[str, Any]:
        """build_tree() keyword arguments from a QosConfig (or defaults) and an optional rate."""
        qos = config or QosConfig()
        return {
            "rate_bps": rate_bps or parse_rate(qos.rate),
            "rate_pct": dict(qos.rate_pct),
            "ceil_pct": dict(qos.ceil_pct),
            "leaf_limit": qos.leaf_limit,
            "dscp": {int(k): v for k, v in qos.dscp.items()},
        }

    def _tree(self, config: QosConfig | None, rate_bps: int | None) -> Tree:
        try:
            return build_tree(**self.inputs(config, rate_bps))
        except ValueError as exc:
            raise DatapathError(f"bad QoS settings: {exc}") from None

    def _needs_compile(self, link: Link, reload: bool) -> tuple[bool, int | None]:
        """(compile?, id of the attached current program): compile when the attached filter is
        not the current source version or a pinned map is missing."""
        name = classifier.prog_name()
        current = [f for f in link.filters() if f.kind == "bpf" and f.name == name]
        pins_ok = all(os.path.exists(p) for p in classifier.pin_paths(self.places.pin_dir).values())
        return reload or not (current and pins_ok), current[0].prog_id if current else None

    # ---- operations -----------------------------------------------------------------

    def apply(
        self, config: QosConfig | None = None, rate_bps: int | None = None, reload: bool = False
    ) -> dict[str, Any]:
        """Make the interface match `config` (a turbonode.config.QosConfig; defaults if None).
        `reload` recompiles and swaps the program even when the attached one is current.
        Returns {"changes": n, "prog_id": id, "leaf_kind": kind, "compiled": bool,
        "extra_classes": [classes deleted], "extra_filters": [filters deleted],
        "stale": [netns/dev entries cleaned]}. An apply that fails after it replaced the
        kernel's default root deletes its root again: the device is as it was."""
        tree = self._tree(config, rate_bps)
        self.require_caps()
        with self._changing("apply"), Link(self.dev, self.netns) as link:
            stale = self._sweep(link)
            owner = reconcile.read_owner(link)[1]
            try:
                done = self._reconcile(link, tree, reload)
            except Exception as exc:
                if owner != "default":
                    raise  # refused (not ours), or turbonode's tree: the next apply finishes it
                back = self._roll_back(link)
                if isinstance(exc, TurbonodeError):
                    raise type(exc)(f"{exc}; {back}") from None
                raise
        for what, extra in (("classes", done["extra_classes"]), ("filters", done["extra_filters"])):
            if extra:
                log.warning("%s: deleted %s turbonode does not define: %s", self._where(), what, ", ".join(extra))
        return {**done, "stale": stale}

    def _reconcile(self, link: Link, tree: Tree, reload: bool) -> dict[str, Any]:
        """apply's changes. The classifier comes before the classes and leaves, so a build that
        fails on an existing tree leaves its classes as they were."""
        changes = reconcile.claim_root(link, tree)
        filters = reconcile.reconcile_filters(link)  # first: another filter may hold our prio
        compiled, prog_id = self._needs_compile(link, reload)
        if compiled:
            # Compiling happens in a child: this process never holds LLVM's memory.
            prog_id = classifier.attach_in_child(self.dev, self.netns, self.places.pin_dir, tree)
        else:
            classifier.write_tables(self.places.pin_dir, tree.dscp_table, tree.tier_minors, tree.limit_minors)
        n, classes = reconcile.reconcile_classes(link, tree)
        changes += len(filters) + int(compiled) + n + reconcile.reconcile_leaves(link, tree)
        reconcile.read_back(link, tree, classifier.prog_name())
        return {
            "changes": changes,
            "prog_id": prog_id,
            "leaf_kind": reconcile.leaf_kind(link.qdiscs(), tree.leaves),
            "compiled": compiled,
            "extra_classes": classes,
            "extra_filters": filters,
        }

    def _roll_back(self, link: Link) -> str:
        """Undo a failed apply on a device whose root was the kernel's: delete ours (the kernel
        puts its default back) and the pins. Returns what it did, for the error."""
        try:
            now = reconcile.remove(link, self.places)["root"]
        except TurbonodeError as undo:
            return f"rolling back failed too ({undo}): run `turboctl qos remove`"
        return f"rolled back: the root qdisc is {now} again"

    def _sweep(self, link: Link) -> list[str]:
        """Forget the pins and locks that deleted namespaces, or devices deleted from this one,
        left behind; returns them as "netns/dev"."""
        own = (self.netns or reconcile.HOST, self.dev)
        found = reconcile.entries(self._bpffs, self._run_dir) - {own}
        devices = link.device_names() if self.netns else set()
        cleaned = []
        for ns, dev in reconcile.stale(found, self.netns, devices):
            where = reconcile.places(dev, ns, self._bpffs, self._run_dir)
            lock = FileLock(where.lock_file, remove_dir=True)
            try:
                lock.acquire(CHANGE_ROLE + "sweep", lambda pid, role: "")
            except LockHeld:
                continue  # somebody is working on it right now: not stale
            try:
                reconcile.forget(where)
            finally:
                lock.release()
            cleaned.append(f"{ns}/{dev}")
        if cleaned:
            log.warning("cleaned what deleted namespaces or devices left behind: %s", ", ".join(cleaned))
        return cleaned

    def plan(self, config: QosConfig | None = None, rate_bps: int | None = None) -> list[str]:
        """What apply would change, read from the kernel; changes nothing. [] when current."""
        tree = self._tree(config, rate_bps)
        with self._link() as link:
            root, owner = reconcile.read_owner(link)
            if owner == "foreign":
                assert root is not None
                return [f"refuse: the root qdisc {root.kind} {fmt_handle(root.handle)} is not turbonode's"]
            if owner == "default":
                return [
                    f"replace the root qdisc {root.kind if root else 'none'} with htb 1:",
                    f"create {len(tree.classes)} classes and {len(tree.leaves)} leaf queues",
                    "compile and attach the classifier",
                ]
            assert root is not None
            out = [] if root.defcls == tree.default_minor else ["re-create htb 1: (its default class changes)"]
            out += [f"delete filter {e} (not turbonode's)" for e in reconcile.extra_filters(link.filters())]
            replace, extra = reconcile.class_changes(reconcile.tree_classes(link.classes()), tree)
            out += [f"delete class {fmt_handle(h)} (not in the tree)" for h in extra]
            out += [
                f"set class {fmt_handle(c.handle)} ({c.tier or 'link'}) to rate {format_rate(c.rate_bps)} "
                f"ceil {format_rate(c.ceil_bps)}"
                for c in replace
            ]
            have = {q.parent: q for q in link.qdiscs()}
            kind = reconcile.leaf_kinds(have, tree.leaves)[0]
            out += [
                f"replace leaf {fmt_handle(leaf.handle)} with {kind} limit {leaf.limit}"
                for leaf in tree.leaves
                if not reconcile.leaf_current(have.get(leaf.parent), leaf, kind)
            ]
            if self._needs_compile(link, False)[0]:
                out.append("compile and attach the classifier")
        return out

    def show(self) -> dict[str, Any]:
        """Per-tier counters and class statistics, plus "unparsed" and the applied link rate."""
        with self._link() as link:  # first: names a missing device or namespace
            # each dump once (the agent reads this every few seconds): the owner from them too
            qdiscs = link.qdiscs()
            _, owner, filters = reconcile.owner_of(link, qdiscs)
            self._check_ours(owner)
            classes = link.classes()
        paths = classifier.pin_paths(self.places.pin_dir)
        counters = bpfobj.read_counters(paths["counters"], classifier.COUNTER_SLOTS)
        dscp_table = bpfobj.read_u32_array(paths["dscp_map"], 64)
        limits = []  # a tree of a version before leased limits has no such pin until its next apply
        if os.path.exists(paths["tier_limit"]):
            limits = bpfobj.read_limits(paths["tier_limit"], classifier.NTIERS)
        root = next((c for c in classes if c.handle == ROOT_CLASS), None)
        return {
            "dev": self.dev,
            "netns": self.netns,
            "rate_bps": root.rate_bps if root else None,
            "leaf_kind": reconcile.leaf_kind(qdiscs, tier_leaves(0)),
            "prog_id": next((f.prog_id for f in filters if f.kind == "bpf"), None),
            "tiers": tier_rows(counters, classes, dscp_table, limits, bpfobj.kernel_clock_ns(), time.time()),
        }

    def set_map(self, mapping: dict[int, str]) -> None:
        """Change DSCP -> tier entries in the live map (the program is not reloaded). Until
        the next apply: apply is declarative and writes the configured map."""
        entries = {}
        for dscp, name in mapping.items():
            if not 0 <= int(dscp) < 64:
                raise DatapathError(f"DSCP {dscp} out of range 0..63")
            try:
                entries[int(dscp)] = tier_by_name(name).index
            except ValueError as exc:
                raise DatapathError(str(exc)) from None
        with self._changing("set-map"), self._link() as link:
            self._require_ours(link)
            path = classifier.pin_paths(self.places.pin_dir)["dscp_map"]
            with bpfobj.PinnedMap(path) as m:
                for dscp, index in entries.items():
                    m.update(dscp, struct.pack("=I", index))

    def set_rate(self, tier: str, rate_bps: int, ceil_bps: int | None = None) -> dict[str, Any]:
        """Change one tier's HTB rate/ceil in place (no reload, queued packets stay queued)."""
        t = self._tier("set-rate", tier)
        with self._changing("set-rate"), self._link() as link:
            got = self._set_class(link, "set-rate", t, t.class_minor, rate_bps, ceil_bps)
        return {"tier": tier, "rate_bps": got.rate_bps, "ceil_bps": got.ceil_bps}

    def _tier(self, op: str, name: str) -> Tier:
        try:
            return tier_by_name(name)
        except ValueError as exc:
            raise DatapathError(f"{op} {name}: {exc}") from None

    def _set_class(
        self, link: Link, op: str, t: Tier, minor: int, rate_bps: int | None, ceil_bps: int | None
    ) -> ClassState:
        """Set class 1:<minor> of tier `t` to rate (None: its current one) and ceil; read back."""
        self._require_ours(link)
        have = {c.handle: c for c in link.classes()}
        cur, root = have.get(class_handle(minor)), have.get(ROOT_CLASS)
        if cur is None or root is None:
            raise DatapathError(
                f"no class {fmt_handle(class_handle(minor))} for {t.name} on {self._where()}: run `turboctl qos apply`"
            )
        try:
            old = htb_class(t.name, minor, ROOT_CLASS, cur.rate_bps, cur.ceil_bps, t.prio)
            new = with_rate(old, root.rate_bps, cur.rate_bps if rate_bps is None else rate_bps, ceil_bps)
        except ValueError as exc:
            raise DatapathError(f"{op} {t.name}: {exc}") from None
        link.replace_class(new)
        got: ClassState | None = {c.handle: c for c in link.classes()}.get(new.handle)
        if got is None or got.rate_bps != new.rate_bps // 8 * 8 or got.ceil_bps != new.ceil_bps // 8 * 8:
            raise DatapathError(
                f"read-back: class {fmt_handle(new.handle)} for {t.name} is {got}, "
                f"wanted rate {new.rate_bps} ceil {new.ceil_bps}"
            )
        return got

    # ---- leased limits (docs/qos.md, "Leased limits") ----------------------------------

    def limit(self, tier: str, ceil_bps: int, lease_s: float) -> dict[str, Any]:
        """Lower `tier`'s ceiling to ceil_bps (at least the limit class's rate) for lease_s
        seconds: the ceiling is set on the tier's limit class, and the classifier steers the
        tier there until the lease's deadline unless renew() moves it on. Returns {"tier",
        "class", "ceil_bps", "until" (wall-clock time)}."""
        t = self._limited("limit", tier)
        with self._changing("limit"), self._link() as link:
            got = self._set_class(link, "limit", t, t.limit_minor, None, ceil_bps)
            until = self._lease(t, lease_s)
        return {"tier": tier, "class": fmt_handle(got.handle), "ceil_bps": got.ceil_bps, "until": until}

    def renew(self, tier: str, lease_s: float) -> float:
        """Move the lease of `tier`'s limit on to lease_s from now (one map write, no netlink);
        returns the new deadline as wall-clock time."""
        t = self._limited("renew", tier)
        with self._changing("renew"):
            return self._lease(t, lease_s)

    def lift(self, tier: str) -> None:
        """End the lease of `tier`'s limit now: the tier is back at its own class's ceiling."""
        t = self._limited("lift", tier)
        with self._changing("lift"):
            bpfobj.write_limit(classifier.pin_paths(self.places.pin_dir)["tier_limit"], t.index, 0, t.limit_minor)

    def _limited(self, op: str, name: str) -> Tier:
        t = self._tier(op, name)
        if not t.limit_minor:
            raise DatapathError(f"{op} {name}: the tier has no limit class (turbonode/tiers.py)")
        return t

    def _lease(self, t: Tier, lease_s: float) -> float:
        try:
            check_ttl(lease_s)  # the agent's lease is its throttle's: at most the worker's longest
        except ValueError as exc:
            raise DatapathError(f"lease of the {t.name} limit: {exc}") from None
        now = bpfobj.kernel_clock_ns()
        path = classifier.pin_paths(self.places.pin_dir)["tier_limit"]
        bpfobj.write_limit(path, t.index, now + int(lease_s * 1e9), t.limit_minor)
        return time.time() + lease_s

    def remove(self) -> dict[str, Any]:
        """Remove everything turbonode put on the interface; the kernel's default root qdisc
        comes back. With the namespace or device gone (and the kernel's tree with it), forget
        the pins it left: {"removed": False, "stale": ["netns/dev"]}."""
        with self._changing("remove"):
            try:
                link = Link(self.dev, self.netns)
            except NoDeviceError:
                if not reconcile.forget(self.places):
                    raise
                entry = f"{self.netns or reconcile.HOST}/{self.dev}"
                log.warning("%s is gone; cleaned the pins it left (%s)", self._where(), self.places.pin_dir)
                return {"removed": False, "root": None, "restored": True, "stale": [entry]}
            with link:
                return reconcile.remove(link, self.places)
