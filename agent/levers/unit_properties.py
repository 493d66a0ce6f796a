"""The cgroup knobs the levers write, as the systemd unit properties that own them (pure).

Where systemd owns a cgroup (it is a unit's: a service, scope or slice), a raw write to its knob
file lasts until systemd next applies the unit's settings (a `systemctl daemon-reload`, a
`set-property`, the unit's restart): systemd resets it, silently. So the systemd writer
(agent/levers/writers.py) sets the unit property instead, at runtime (lost at reboot, kept across
daemon-reload). This module maps a lever's (knob file, value) to (property, value) and back; the
values are text, uint64s in decimal and UINT64_MAX ("unset", "no limit") as `infinity`:

  cpu.weight N            CPUWeight N            (v1 cpu.shares S: CPUWeight S*100/1024, systemd's
                                                  own conversion the other way)
  cpu.max "Q P" | "max P" CPUQuotaPerSecUSec Q*1e6/P | infinity   (v1 cpu.cfs_quota_us, at the
                                                  lever's period; cpu.cfs_period_us goes with it)
  memory.high|low|min|max MemoryHigh|Low|Min|Max N | infinity
  io.weight "default N"   IOWeight N             (io.bfq.weight: systemd writes it from IOWeight)
  io.max DEV "wbps=B wiops=I"   IOWriteBandwidthMax and IOWriteIOPSMax of /dev/block/DEV, one knob
                                named IO_WRITE_MAX whose value is "wbps=B wiops=I" (max: none)

Anything else (v1's memory.oom_control and memory.limit_in_bytes, blkio.*) has no property the
lever's meaning survives in: `Unmapped`, and the writer refuses rather than write a file systemd owns.
"""

from __future__ import annotations

from turbonode.cgroups import PERIOD_US, V2_WEIGHT_MAX, V2_WEIGHT_MIN
from turbonode.errors import TurbonodeError

UINT64_MAX = (1 << 64) - 1
INFINITY = "infinity"
IO_WRITE_MAX = "IOWriteMax"  # the io.max knob: IOWriteBandwidthMax + IOWriteIOPSMax of one device
IO_WRITE_NONE = "wbps=max wiops=max"  # a device with no write limit in the unit
MEMORY = {"memory.high": "MemoryHigh", "memory.low": "MemoryLow", "memory.min": "MemoryMin", "memory.max": "MemoryMax"}
SKIPPED = ("io.bfq.weight", "cpu.cfs_period_us")  # systemd writes them from another property
# a unit property's D-Bus type, for SetUnitProperties
SIGNATURES = {"CPUWeight": "t", "CPUQuotaPerSecUSec": "t", "IOWeight": "t", **{p: "t" for p in MEMORY.values()}}


class Unmapped(TurbonodeError):
    """A knob no systemd property stands for."""


def _uint(text: str, unlimited: tuple[str, ...] = ("max",)) -> str:
    return INFINITY if text in unlimited else str(int(text))


def to_property(knob: str, value: str) -> tuple[str, str] | None:
    """(property, value) for writing `value` to knob file `knob`; None: nothing to set (systemd
    derives it from another property). Raises Unmapped, or ValueError for a value not the knob's."""
    if knob in SKIPPED:
        return None
    if knob == "cpu.weight":
        return "CPUWeight", str(int(value))
    if knob == "cpu.shares":  # v1: the lever converted a weight x1024/100; systemd converts it back
        return "CPUWeight", str(max(V2_WEIGHT_MIN, min(V2_WEIGHT_MAX, round(int(value) * 100 / 1024))))
    if knob == "cpu.max":
        quota, period = value.split()
        return "CPUQuotaPerSecUSec", INFINITY if quota == "max" else str(int(quota) * 1_000_000 // int(period))
    if knob == "cpu.cfs_quota_us":
        return "CPUQuotaPerSecUSec", INFINITY if value.strip() == "-1" else str(int(value) * 1_000_000 // PERIOD_US)
    if knob in MEMORY:
        return MEMORY[knob], _uint(value.strip())
    if knob == "io.weight":
        return "IOWeight", str(int(value.split()[-1]))
    if knob == "io.max":
        return IO_WRITE_MAX, io_write_value(value)
    raise Unmapped(f"{knob} has no systemd unit property")


def io_write_value(value: str) -> str:
    """An io.max line's write limits, as the IO_WRITE_MAX knob's value ('wbps=B wiops=I')."""
    fields = dict(f.split("=", 1) for f in value.split() if "=" in f)
    return f"wbps={fields.get('wbps', 'max')} wiops={fields.get('wiops', 'max')}"


def dbus_uint(text: str) -> int:
    return UINT64_MAX if text == INFINITY else int(text)


def text_uint(value: int) -> str:
    return INFINITY if value == UINT64_MAX else str(value)


def device_path(device: str) -> str:
    """How a unit names a disk ("MAJ:MIN"): systemd resolves /dev/block/MAJ:MIN like any node."""
    return f"/dev/block/{device}"


def io_write_entries(device: str, value: str) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """The IO_WRITE_MAX knob's value for `device` as (property, signature, entries) to set."""
    fields = dict(f.split("=", 1) for f in value.split())
    return [
        (prop, "a(st)", [(device_path(device), dbus_uint(_uint(fields.get(name, "max"))))])
        for prop, name in (("IOWriteBandwidthMax", "wbps"), ("IOWriteIOPSMax", "wiops"))
    ]


def io_write_read(device: str, bandwidth: list[tuple[str, int]], iops: list[tuple[str, int]]) -> str:
    """The IO_WRITE_MAX knob's value for `device` from the unit's two lists (absent: max)."""
    path = device_path(device)

    def limit(entries: list[tuple[str, int]]) -> str:
        found = [v for p, v in entries if p == path]
        return "max" if not found or found[-1] == UINT64_MAX else str(found[-1])

    return f"wbps={limit(bandwidth)} wiops={limit(iops)}"
