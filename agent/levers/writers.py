"""Who applies the values the levers compute: the cgroup files themselves, or systemd.

The levers are policy: each computes (knob file, value) pairs for the cgroups it acts on
(turbonode/cgroups.py, memory_cgroups.py) and hands them to the journal (agent/levers/journal.py),
which asks its writer where each goes:

  CgroupfsWriter  writes the file. Hosts without systemd as PID 1 (containers, the development
                  VM): nobody else owns the tree.
  SystemdWriter   where PID 1 is systemd. A knob of a cgroup that is a unit's own (its path ends
                  in a .service, .scope or .slice) becomes that unit's property, set at runtime
                  over D-Bus (agent/levers/unit_properties.py, systemd_bus.py): systemd resets a
                  raw write to a unit's cgroup whenever it applies the unit again (daemon-reload,
                  set-property, restart), silently undoing the lever, while a runtime property is
                  kept until reboot or until we set the old value back. A cgroup below a unit (a
                  subtree systemd delegated, `Delegate=yes`, or one made inside a unit's) is
                  written raw: systemd leaves those alone. A knob no property stands for is refused
                  and named (the lever reports it), never written behind systemd's back.

Either way the journal records the original and the value written, by the knob's name: a file's
path, or `systemd:UNIT:PROPERTY` for a unit property, so release, stop and the next agent after
a kill -9 put back what was there, through whichever writer the name says (a cgroupfs writer
asks systemd too for a unit property a previous agent left).

`choose_writer` picks by what the host is: PID 1 (`<procfs>/1/comm`) is systemd and
/run/systemd/system exists (sd_booted). Which one runs, and why, is in status
(`actions.levers.writer`), `turboctl doctor` (`lever writer`) and turbonode_lever_mode.
"""

from __future__ import annotations

import os
from typing import Any

from .journal import KnobError, read_knob, write_knob
from .systemd_bus import INTERFACES, SystemdBus, SystemdError
from .unit_properties import (
    IO_WRITE_MAX,
    IO_WRITE_NONE,
    SIGNATURES,
    Unmapped,
    dbus_uint,
    io_write_entries,
    io_write_read,
    text_uint,
    to_property,
)

UNIT_PREFIX = "systemd:"
CGROUPFS, SYSTEMD = "cgroupfs", "systemd"
WRITERS = (CGROUPFS, SYSTEMD)  # turbonode_lever_mode{lever="writer"}
Routed = tuple[str, str, "str | None", "str | None"]  # (path or unit knob, value, key, absent)


def unit_knob(unit: str, prop: str) -> str:
    return f"{UNIT_PREFIX}{unit}:{prop}"


def is_unit_knob(path: str) -> bool:
    return path.startswith(UNIT_PREFIX)


def unit_of_cgroup(cgroup: str) -> tuple[str | None, bool]:
    """(the unit whose cgroup `cgroup` is, or None; whether it lies below a unit instead: a
    delegated or hand-made subtree, which systemd leaves alone)."""
    parts = [p for p in cgroup.strip("/").split("/") if p]
    units = [i for i, p in enumerate(parts) if p.endswith(tuple(INTERFACES))]
    if not units:
        return None, False
    if units[-1] == len(parts) - 1:
        return parts[-1], False
    return None, True


def pid1(procfs: str = "/proc") -> str:
    try:
        with open(os.path.join(procfs, "1", "comm")) as f:
            return f.read().strip()
    except OSError as exc:
        return f"unknown ({exc.strerror or exc})"


class CgroupfsWriter:
    """Writes the knob files; asks systemd only for a unit property a previous agent left."""

    backend = CGROUPFS

    def __init__(self, why: str = "", bus: SystemdBus | None = None):
        self.why, self.bus = why, bus

    def route(self, path: str, value: str, key: str | None, absent: str | None) -> Routed | None:
        return path, value, key, absent

    def read(self, path: str, key: str | None = None, absent: str | None = None) -> str:
        if not is_unit_knob(path):
            return read_knob(path, key, absent)
        unit, prop = self._unit(path)
        try:
            bus = self._bus(path)
            if prop == IO_WRITE_MAX:
                assert key is not None
                bw, iops = (bus.get_property(unit, p) for p in ("IOWriteBandwidthMax", "IOWriteIOPSMax"))
                return io_write_read(key, bw, iops)
            return text_uint(bus.get_property(unit, prop))
        except SystemdError as exc:
            raise KnobError(f"cannot read {prop} of {unit}: {exc}") from None

    def write(self, path: str, value: str, key: str | None = None, absent: str | None = None) -> None:
        if not is_unit_knob(path):
            write_knob(path, value, key, absent)
            return
        unit, prop = self._unit(path)
        props: list[tuple[str, tuple[str, Any]]]
        if prop == IO_WRITE_MAX:
            assert key is not None
            props = [(p, (sig, entries)) for p, sig, entries in io_write_entries(key, value)]
        else:
            props = [(prop, (SIGNATURES[prop], dbus_uint(value)))]
        try:
            self._bus(path).set_properties(unit, props)
        except SystemdError as exc:
            raise KnobError(f"cannot set {prop}={value} on {unit}: {exc}") from None

    def enables(self, path: str) -> bool:
        """Whether setting knob `path` through this writer makes its cgroup's controller (and the
        file) appear: never for a file written directly."""
        return False

    def _unit(self, path: str) -> tuple[str, str]:
        unit, _, prop = path[len(UNIT_PREFIX) :].rpartition(":")
        return unit, prop

    def _bus(self, path: str) -> SystemdBus:
        if self.bus is None:
            raise SystemdError(f"{path} is a unit property, and systemd is not PID 1 here to ask")
        return self.bus

    def status(self) -> dict[str, Any]:
        return {"backend": self.backend, "why": self.why}


class SystemdWriter(CgroupfsWriter):
    """Routes a knob of a unit's own cgroup to the unit's property; the rest to the file."""

    backend = SYSTEMD

    def __init__(self, bus: SystemdBus, cgroup_root: str = "/sys/fs/cgroup", why: str = ""):
        super().__init__(why, bus)
        self.root = cgroup_root.rstrip("/")

    def owner(self, path: str) -> tuple[str, str] | None:
        """(unit, knob file) where `path` is a knob of a unit's own cgroup; None otherwise."""
        rel = os.path.relpath(path, self.root)
        if rel.startswith(".."):
            return None  # not a cgroup knob: /proc/PID/oom_score_adj, sysctls
        parts = rel.split("/")
        if not os.path.exists(os.path.join(self.root, "cgroup.controllers")):
            parts = parts[1:]  # v1 or hybrid: the first part names the hierarchy's mount
        if len(parts) < 2:
            return None
        unit, _ = unit_of_cgroup("/".join(parts[:-1]))
        return None if unit is None else (unit, parts[-1])

    def enables(self, path: str) -> bool:
        """A unit's own cgroup: systemd enables a controller for it (and its parents) when one of
        its properties asks for it (IOWriteBandwidthMax=, CPUWeight=, ...), so a stock v2 host,
        where no unit asked, has no io.max or cpu.weight there until the lever sets one."""
        return self.owner(path) is not None

    def route(self, path: str, value: str, key: str | None, absent: str | None) -> Routed | None:
        owned = self.owner(path)
        if owned is None:
            return path, value, key, absent
        unit, knob = owned
        try:
            mapped = to_property(knob, value)
        except Unmapped:
            raise KnobError(
                f"systemd owns {unit}, and its {knob} has no unit property: not written (systemd would "
                "undo a raw write at its next daemon-reload)"
            ) from None
        if mapped is None:
            return None
        prop, prop_value = mapped
        if prop == IO_WRITE_MAX:
            return unit_knob(unit, prop), prop_value, key, IO_WRITE_NONE
        return unit_knob(unit, prop), prop_value, None, None


def choose_writer(
    procfs: str = "/proc", cgroup_root: str = "/sys/fs/cgroup", booted: str = "/run/systemd/system"
) -> CgroupfsWriter:
    """systemd's writer where PID 1 is systemd (sd_booted), else the files'."""
    init = pid1(procfs)
    if init == "systemd" and os.path.isdir(booted):
        why = "PID 1 is systemd: a unit's cgroup is changed through its properties (runtime, over D-Bus)"
        return SystemdWriter(SystemdBus(), cgroup_root, why)
    return CgroupfsWriter(f"PID 1 is {init}, not systemd: cgroup files written directly")
