"""Thin pyroute2 edge for tc: one interface in one network namespace.

Only this module talks rtnetlink. Every NetlinkError/OSError becomes a turbonode.errors
exception that names the device and the operation.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST, nlmsg
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_DELTFILTER
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from turbonode import caps
from turbonode.errors import DatapathError, NoDeviceError, NotRootError

from .tree import FILTER_HANDLE, FILTER_PRIO, OWNER_R2Q, ROOT_HANDLE, HtbClass, fmt_handle

ETH_P_ALL = 0x0003
TC_H_ROOT = 0xFFFFFFFF
TCA_BPF_ID = 11  # linux/pkt_cls.h: the attached program's id (pyroute2 0.9 does not decode it)
TCA_CHAIN = 11  # linux/rtnetlink.h: a filter's chain (pyroute2 0.9 neither decodes nor sends it)
NLA_TYPE_MASK = 0x3FFF
TCMSG_ATTRS = 16 + 20  # a tc message's attributes follow struct nlmsghdr and struct tcmsg
# pyroute2 warns on every fq_codel parameter ("naming will change"); the names are pinned here.
logging.getLogger("pyroute2.netlink.rtnl.tcmsg.sched_fq_codel").setLevel(logging.ERROR)


class UnsupportedKind(DatapathError):
    """The kernel has no qdisc of that kind (not built, module not loadable)."""


@dataclass(frozen=True)
class Qdisc:
    kind: str
    handle: int
    parent: int
    limit: int | None = None
    defcls: int | None = None
    r2q: int | None = None  # htb only: turbonode's root carries OWNER_R2Q


@dataclass(frozen=True)
class ClassState:
    handle: int
    parent: int
    rate_bps: int
    ceil_bps: int
    prio: int
    quantum: int
    bytes: int
    packets: int
    drops: int
    backlog_bytes: int
    backlog_packets: int
    borrows: int
    lends: int


@dataclass(frozen=True)
class FilterState:
    kind: str
    parent: int
    prio: int
    handle: int
    name: str | None
    prog_id: int | None
    classid: int | None
    direct_action: bool
    chain: int = 0


class _FilterDelete(nlmsg):  # type: ignore[misc]  # pyroute2 has no type information
    """RTM_DELTFILTER with the chain it deletes from: tcmsg has no TCA_CHAIN, and a subclass of
    it would inherit its compiled attribute table once tcmsg has been used (pyroute2 0.9)."""

    fields = tcmsg.fields
    nla_map = ((0, "TCA_UNSPEC", "none"), (TCA_CHAIN, "TCA_CHAIN", "uint32"))


def raw_u32(nested: Any, nla_type: int) -> int | None:
    """A u32 attribute pyroute2 left undecoded, read from the nested attribute's own bytes."""
    return _u32_attr(nested.data, nested.offset + 4, nested.offset + nested.length, nla_type)


def _u32_attr(data: bytes, pos: int, end: int, nla_type: int) -> int | None:
    """The u32 attribute `nla_type` among the attributes in data[pos:end]."""
    while pos + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, pos)
        if length < 4:
            return None
        if kind & NLA_TYPE_MASK == nla_type and length >= 8:
            return int(struct.unpack_from("=I", data, pos + 4)[0])
        pos += (length + 3) & ~3
    return None


def require_net_admin(what: str) -> None:
    missing = caps.missing_net_admin()
    if missing:
        raise NotRootError(caps.lacks(missing, what))


def require_netns_entry(netns: str | None) -> None:
    """setns() into a named namespace needs CAP_SYS_ADMIN: the kernel's EPERM does not say so."""
    missing = caps.missing_sys_admin() if netns else None
    if missing:
        raise NotRootError(caps.lacks(missing, f"entering netns {netns}"))


def root_of(qdiscs: Iterable[Qdisc]) -> Qdisc | None:
    """The root qdisc among a link's."""
    return next((q for q in qdiscs if q.parent == TC_H_ROOT), None)


class Link:
    """rtnetlink for tc on device `dev` inside named netns `netns` (None: this process's own)."""

    def __init__(self, dev: str, netns: str | None = None):
        self.dev = dev
        self.netns = netns
        where = f" in netns {netns}" if netns else ""
        self.where = f"{dev}{where}"
        require_net_admin(f"tc on {self.where}")
        if netns and not os.path.exists(f"/run/netns/{netns}"):
            raise NoDeviceError(f"unknown network namespace {netns!r} (no /run/netns/{netns})")
        require_netns_entry(netns)
        try:
            # flags=0: never create the namespace as a side effect of opening it.
            self.ipr = IPRoute(netns=netns, flags=0) if netns else IPRoute()
        except (OSError, NetlinkError) as exc:
            raise self._error("open rtnetlink", exc) from None
        try:
            found = self.ipr.link_lookup(ifname=dev)
        except (OSError, NetlinkError) as exc:
            self.close()
            raise self._error("look up device", exc) from None
        if not found:
            self.close()
            raise NoDeviceError(f"unknown device {self.where}")
        self.ifindex = found[0]

    def close(self) -> None:
        self.ipr.close()

    def device_names(self) -> set[str]:
        """Every interface name in this link's namespace."""
        try:
            return {msg.get_attr("IFLA_IFNAME") for msg in self.ipr.get_links()}
        except (OSError, NetlinkError) as exc:
            raise self._error("list devices", exc) from None

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, what: str, exc: Exception) -> DatapathError:
        code = getattr(exc, "code", None) or getattr(exc, "errno", None) or 0
        msg = f"{what} on {self.where}: {os.strerror(code) if code else exc}"
        if code in (errno.EPERM, errno.EACCES):
            missing = caps.missing_net_admin()
            if missing:
                return NotRootError(caps.lacks(missing, f"{what} on {self.where}"))
            return NotRootError(msg + " (refused although this process has CAP_NET_ADMIN: a seccomp filter or LSM?)")
        if code == errno.ENODEV:
            return NoDeviceError(f"unknown device {self.where}")
        return DatapathError(msg)

    def _tc(self, what: str, *args: Any, **kw: Any) -> Any:
        try:
            return self.ipr.tc(*args, **kw)
        except (OSError, NetlinkError) as exc:
            raise self._error(what, exc) from None

    def _dump(self, what: str, method: str, **kw: Any) -> list[Any]:
        try:
            return list(getattr(self.ipr, method)(index=self.ifindex, **kw))
        except (OSError, NetlinkError) as exc:
            raise self._error(what, exc) from None

    # ---- qdiscs ---------------------------------------------------------------------

    def qdiscs(self) -> list[Qdisc]:
        out = []
        for msg in self._dump("dump qdiscs", "get_qdiscs"):
            if msg["index"] != self.ifindex:
                continue
            opts = msg.get_attr("TCA_OPTIONS")
            limit = defcls = r2q = None
            if opts is not None:
                kind = msg.get_attr("TCA_KIND")
                if kind == "htb":
                    init = opts.get_attr("TCA_HTB_INIT")
                    defcls = init["defcls"] if init else None
                    r2q = init["rate2quantum"] if init else None
                elif kind == "fq_codel":
                    limit = opts.get_attr("TCA_FQ_CODEL_LIMIT")
                elif kind in ("pfifo", "bfifo"):
                    limit = opts.get("limit") if hasattr(opts, "get") else None
            out.append(Qdisc(msg.get_attr("TCA_KIND"), msg["handle"], msg["parent"], limit, defcls, r2q))
        return out

    def root_qdisc(self) -> Qdisc | None:
        return root_of(self.qdiscs())

    def replace_htb_root(self, default_minor: int) -> None:
        """Our root, with its ownership mark set in the same message that creates it."""
        self._tc(
            "replace the root qdisc with htb 1:",
            "replace",
            "htb",
            self.ifindex,
            ROOT_HANDLE,
            parent=TC_H_ROOT,
            default=default_minor,
            r2q=OWNER_R2Q,
        )

    def delete_root(self) -> None:
        self._tc("delete the root qdisc", "del", index=self.ifindex, parent=TC_H_ROOT)

    def replace_leaf(self, kind: str, parent: int, handle: int, limit: int) -> None:
        params = {"fqc_limit": limit} if kind == "fq_codel" else {"limit": limit}
        try:
            self.ipr.tc("replace", kind, self.ifindex, handle, parent=parent, **params)
        except NetlinkError as exc:
            # ENOENT/EOPNOTSUPP: this kernel has no such qdisc (fq_codel is not always built).
            if exc.code in (errno.ENOENT, errno.EOPNOTSUPP):
                raise UnsupportedKind(f"no {kind} qdisc in this kernel") from None
            raise self._error(f"replace leaf {kind} {fmt_handle(handle)}", exc) from None

    def delete_leaf(self, parent: int, handle: int) -> None:
        """Delete the qdisc under a class (HTB puts a default pfifo there until the next one)."""
        self._tc(f"delete leaf {fmt_handle(handle)}", "del", index=self.ifindex, parent=parent, handle=handle)

    # ---- HTB classes ----------------------------------------------------------------

    def replace_class(self, c: HtbClass) -> None:
        self._tc(
            f"replace class {fmt_handle(c.handle)}",
            "replace-class",
            "htb",
            self.ifindex,
            c.handle,
            parent=c.parent,
            rate=c.rate_bps // 8,
            ceil=c.ceil_bps // 8,
            prio=c.prio,
            burst=c.burst,
            cburst=c.cburst,
            quantum=c.quantum,
        )

    def delete_class(self, handle: int) -> None:
        # No kind: with "htb" pyroute2 builds (and fails on) rate tables a delete does not carry.
        self._tc(f"delete class {fmt_handle(handle)}", "del-class", index=self.ifindex, handle=handle)

    def classes(self) -> list[ClassState]:
        out = []
        for msg in self._dump("dump classes", "get_classes"):
            if msg["index"] != self.ifindex or msg.get_attr("TCA_KIND") != "htb":
                continue
            parms = msg.get_nested("TCA_OPTIONS", "TCA_HTB_PARMS") or {}
            opts = msg.get_attr("TCA_OPTIONS")
            rate64 = opts.get_attr("TCA_HTB_RATE64") if opts else None
            ceil64 = opts.get_attr("TCA_HTB_CEIL64") if opts else None
            stats2 = msg.get_attr("TCA_STATS2")
            basic = stats2.get_attr("TCA_STATS_BASIC") if stats2 else None
            queue = stats2.get_attr("TCA_STATS_QUEUE") if stats2 else None
            app = stats2.get_attr("TCA_STATS_APP") if stats2 else None
            out.append(
                ClassState(
                    handle=msg["handle"],
                    parent=msg["parent"],
                    rate_bps=8 * (rate64 or parms.get("rate", 0)),
                    ceil_bps=8 * (ceil64 or parms.get("ceil", 0)),
                    prio=parms.get("prio", 0),
                    quantum=parms.get("quantum", 0),
                    bytes=basic["bytes"] if basic else 0,
                    packets=basic["packets"] if basic else 0,
                    drops=queue["drops"] if queue else 0,
                    backlog_bytes=queue["backlog"] if queue else 0,
                    backlog_packets=queue["qlen"] if queue else 0,
                    borrows=app["borrows"] if app else 0,
                    lends=app["lends"] if app else 0,
                )
            )
        return out

    # ---- the classifier filter ------------------------------------------------------

    def replace_bpf_filter(self, prog_fd: int, name: str) -> None:
        """Attach (or atomically swap) the classifier on 1: at a fixed prio/handle."""
        self._tc(
            "attach the classifier",
            "replace-filter",
            "bpf",
            self.ifindex,
            FILTER_HANDLE,
            parent=ROOT_HANDLE,
            prio=FILTER_PRIO,
            protocol=ETH_P_ALL,
            fd=prog_fd,
            name=name,
            classid=ROOT_HANDLE,
            direct_action=True,
        )

    def delete_filters(self, chain: int, prio: int, handle: int = 0) -> None:
        """Delete the filter `handle` of prio `prio` in chain `chain` of 1:; handle 0 deletes
        every filter of that prio (whatever its kind and protocol: protocol 0 matches any)."""
        msg = _FilterDelete()
        msg["index"], msg["parent"], msg["handle"], msg["info"] = self.ifindex, ROOT_HANDLE, handle, prio << 16
        msg["attrs"] = [("TCA_CHAIN", chain)]
        msg["header"]["type"], msg["header"]["flags"] = RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK
        try:
            list(self.ipr.nlm_request_batch([msg]))  # its nlm_request() fails in pyroute2 0.9 (KeyError)
        except (OSError, NetlinkError) as exc:
            raise self._error(f"delete filter pref {prio} chain {chain}", exc) from None

    def filters(self, parent: int = ROOT_HANDLE) -> list[FilterState]:
        out = []
        for msg in self._dump("dump filters", "get_filters", parent=parent):
            kind = msg.get_attr("TCA_KIND")
            opts = msg.get_attr("TCA_OPTIONS")
            if kind is None or (kind == "bpf" and opts is None):
                continue  # the per-prio chain header the kernel dumps before the filters
            flags = opts.get_attr("TCA_BPF_FLAGS") if kind == "bpf" else 0
            out.append(
                FilterState(
                    kind=kind,
                    parent=msg["parent"],
                    prio=msg["info"] >> 16,
                    handle=msg["handle"],
                    name=opts.get_attr("TCA_BPF_NAME") if kind == "bpf" else None,
                    prog_id=raw_u32(opts, TCA_BPF_ID) if kind == "bpf" else None,
                    classid=opts.get_attr("TCA_BPF_CLASSID") if kind == "bpf" else None,
                    direct_action=bool((flags or 0) & 1),
                    chain=_u32_attr(msg.data, msg.offset + TCMSG_ATTRS, msg.offset + msg.length, TCA_CHAIN) or 0,
                )
            )
        return out
