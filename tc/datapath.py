"""The QoS datapath of one interface: the API the agent and `turboctl qos` use.

    dp = Datapath("eth0", netns=None)
    dp.apply(qos_config)          # declarative: same config twice changes nothing
    dp.show()                     # {tier: {packets, bytes, htb_sent_bytes, drops, backlog_*, borrowed, ...}}
    dp.set_map({46: "turbo"})     # live DSCP -> tier change, no reload
    dp.set_rate("relax", 5_000_000, 100_000_000)   # live class change, no reload
    dp.remove()                   # restores the interface's previous root qdisc

The datapath lives on in the kernel when the process exits. A Datapath object keeps one
rtnetlink socket open for its frequent calls (show, set_map, set_rate: opening one inside a
namespace forks, ~25 ms); close() or `with` releases it. Calls on one object serialise on a lock.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from turbonode.config import QosConfig
from turbonode.errors import DatapathError
from turbonode.rates import parse_rate
from turbonode.tiers import tier as tier_by_name

from . import bpfobj, classifier, reconcile
from .class_stats import tier_rows
from .netlink import Link
from .tree import Tree, build_tree, with_rate


class Datapath:
    def __init__(
        self, dev: str, netns: str | None = None, *, bpffs: str = "/sys/fs/bpf", run_dir: str = "/run/turbonode"
    ):
        if not dev:
            raise DatapathError("no device given")
        self.dev = dev
        self.netns = netns or None
        self.places = reconcile.places(dev, self.netns, bpffs, run_dir)
        self._cached: Link | None = None
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            if self._cached is not None:
                self._cached.close()
                self._cached = None

    def __enter__(self) -> Datapath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                self.close()
                raise

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

    def state(self) -> dict[str, Any] | None:
        return reconcile.load_state(self.places.state_file)

    def _applied(self) -> tuple[dict[str, Any], Tree]:
        state = self.state()
        if state is None or "inputs" not in state:
            raise DatapathError(f"no turbonode QoS on {self._where()}: run `turboctl qos apply` first")
        state["inputs"]["dscp"] = {int(k): v for k, v in state["inputs"]["dscp"].items()}  # JSON keys are str
        return state, build_tree(**state["inputs"])

    def _where(self) -> str:
        return f"{self.dev} in netns {self.netns}" if self.netns else self.dev

    # ---- operations -----------------------------------------------------------------

    def apply(
        self, config: QosConfig | None = None, rate_bps: int | None = None, reload: bool = False
    ) -> dict[str, Any]:
        """Make the interface match `config` (a turbonode.config.QosConfig; defaults if None).
        `reload` recompiles and swaps the program even when the attached one is current.
        Returns {"changes": n, "prog_id": id, "leaf_kind": kind, "compiled": bool}."""
        inputs = self.inputs(config, rate_bps)
        try:
            tree = build_tree(**inputs)
        except ValueError as exc:
            raise DatapathError(f"bad QoS settings: {exc}") from None
        with Link(self.dev, self.netns) as link:
            state = reconcile.claim_root(link, tree, self.state(), self.places.state_file)
            changes = reconcile.reconcile_classes(link, tree)
            changes += reconcile.reconcile_leaves(link, tree, state)
            name = classifier.prog_name()
            current = [f for f in link.filters() if f.kind == "bpf" and f.name == name]
            pins_ok = all(os.path.exists(p) for p in classifier.pin_paths(self.places.pin_dir).values())
            compiled = reload or not (current and pins_ok and state.get("prog_id"))
            if compiled:
                # Compiling happens in a child: this process never holds LLVM's memory.
                state["prog_id"] = classifier.attach_in_child(self.dev, self.netns, self.places.pin_dir, tree)
                changes += 1
            else:
                classifier.write_tables(self.places.pin_dir, tree.dscp_table, tree.tier_minors)
            state["inputs"] = inputs
            state["prog_name"] = name
            reconcile.save_state(self.places.state_file, state)
            reconcile.read_back(link, tree, name)
        return {"changes": changes, "prog_id": state["prog_id"], "leaf_kind": state["leaf_kind"], "compiled": compiled}

    def show(self) -> dict[str, Any]:
        """Per-tier counters and class statistics, plus "unparsed" and the applied link rate."""
        with self._link() as link:  # first: names a missing device or namespace
            state, tree = self._applied()
            classes = link.classes()
        paths = classifier.pin_paths(self.places.pin_dir)
        counters = bpfobj.read_counters(paths["counters"], classifier.COUNTER_SLOTS)
        dscp_table = bpfobj.read_u32_array(paths["dscp_map"], 64)
        return {
            "dev": self.dev,
            "netns": self.netns,
            "rate_bps": tree.rate_bps,
            "leaf_kind": state.get("leaf_kind"),
            "prog_id": state.get("prog_id"),
            "tiers": tier_rows(counters, classes, dscp_table),
        }

    def set_map(self, mapping: dict[int, str]) -> None:
        """Change DSCP -> tier entries in the live map (the program is not reloaded). Until
        the next apply: apply is declarative and writes the configured map."""
        with self._link():
            self._applied()
        entries = {}
        for dscp, name in mapping.items():
            if not 0 <= int(dscp) < 64:
                raise DatapathError(f"DSCP {dscp} out of range 0..63")
            try:
                entries[int(dscp)] = tier_by_name(name).index
            except ValueError as exc:
                raise DatapathError(str(exc)) from None
        path = classifier.pin_paths(self.places.pin_dir)["dscp_map"]
        with bpfobj.PinnedMap(path) as m:
            for dscp, index in entries.items():
                m.update(dscp, struct.pack("=I", index))

    def set_rate(self, tier: str, rate_bps: int, ceil_bps: int | None = None) -> dict[str, Any]:
        """Change one tier's HTB rate/ceil in place (no reload, queued packets stay queued)."""
        with self._link() as link:
            _, tree = self._applied()
            try:
                tier_by_name(tier)
                new = with_rate(tree, tier, rate_bps, ceil_bps)
            except ValueError as exc:
                raise DatapathError(f"set-rate {tier}: {exc}") from None
            link.replace_class(new)
            got = {c.handle: c for c in link.classes()}.get(new.handle)
        if got is None or got.rate_bps != new.rate_bps // 8 * 8 or got.ceil_bps != new.ceil_bps // 8 * 8:
            raise DatapathError(f"read-back: class for {tier} is {got}, wanted rate {new.rate_bps} ceil {new.ceil_bps}")
        return {"tier": tier, "rate_bps": got.rate_bps, "ceil_bps": got.ceil_bps}

    def remove(self) -> dict[str, Any]:
        """Remove everything turbonode put on the interface; the previous root qdisc comes back."""
        with Link(self.dev, self.netns) as link:
            return reconcile.remove(link, self.state(), self.places)
