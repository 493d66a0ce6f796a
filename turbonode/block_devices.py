"""Block devices as the io controller's per-device knobs name them: "MAJ:MIN" of a whole disk
(blkio.throttle.*_device on v1, io.max on v2 take no partition), found from sysfs.

`resolve` turns what a configuration names (a "MAJ:MIN", a name such as `nvme0n1`, a /dev path;
a partition stands for its disk) into that; `mounted_disks` lists the disks under the mounted
filesystems (a filesystem on major 0 -- tmpfs, overlay, proc -- is on none); `scheduler` names the
io scheduler a disk runs (whether io weights can act on it: agent/levers/io_policy.py). Readers
take the roots (`sysfs`, `procfs`) so tests run on a fake tree.
"""

from __future__ import annotations

import os

from .errors import TurbonodeError


class DeviceError(TurbonodeError):
    """A block device that does not exist (or cannot be read in sysfs)."""


def _dev_dir(majmin: str, sysfs: str) -> str:
    return os.path.join(sysfs, "dev", "block", majmin)


def disk_of(majmin: str, sysfs: str = "/sys") -> str:
    """The whole disk's "MAJ:MIN" of a device (itself, unless it is a partition)."""
    d = _dev_dir(majmin, sysfs)
    if not os.path.isdir(d):
        raise DeviceError(f"no block device {majmin} ({d})")
    if not os.path.exists(os.path.join(d, "partition")):
        return majmin
    parent = os.path.dirname(os.path.realpath(d))  # .../block/vda/vda1 -> .../block/vda
    try:
        with open(os.path.join(parent, "dev")) as f:
            return f.read().strip()
    except OSError as exc:
        raise DeviceError(f"cannot find the disk of partition {majmin}: {exc.strerror or exc}") from None


def is_majmin(text: str) -> bool:
    major, colon, minor = text.partition(":")
    return bool(colon) and major.isdigit() and minor.isdigit()


def resolve(spec: str, sysfs: str = "/sys") -> str:
    """ "MAJ:MIN", a name ("vda", "nvme0n1p2") or a /dev path -> the "MAJ:MIN" of its whole disk."""
    if is_majmin(spec):
        return disk_of(spec, sysfs)
    name = os.path.basename(spec.rstrip("/"))
    try:
        with open(os.path.join(sysfs, "class", "block", name, "dev")) as f:
            majmin = f.read().strip()
    except OSError:
        raise DeviceError(f"no block device {spec!r} (not in {sysfs}/class/block)") from None
    return disk_of(majmin, sysfs)


def mounted_disks(procfs: str = "/proc", sysfs: str = "/sys") -> list[str]:
    """The whole disks (their "MAJ:MIN") that the filesystems mounted here lie on."""
    path = os.path.join(procfs, "self", "mountinfo")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DeviceError(f"cannot read {path}: {exc.strerror or exc}") from None
    disks: dict[str, None] = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 3 or not is_majmin(fields[2]) or fields[2].startswith("0:"):
            continue
        try:
            disks[disk_of(fields[2], sysfs)] = None
        except DeviceError:
            continue  # not a block device (sysfs has no such dev): nothing to throttle there
    return list(disks)


def scheduler(disk: str, sysfs: str = "/sys") -> str:
    """The io scheduler a whole disk ("MAJ:MIN") runs: the bracketed word of its
    queue/scheduler ("none [mq-deadline] kyber" -> "mq-deadline"; a lone "none" is itself)."""
    path = os.path.join(_dev_dir(disk, sysfs), "queue", "scheduler")
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError as exc:
        raise DeviceError(f"cannot read the io scheduler of {disk}: {exc.strerror or exc}") from None
    chosen = [w[1:-1] for w in words if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else (words[0] if words else "none")
