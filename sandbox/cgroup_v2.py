"""Run on cgroup v2's cpu controller on a hybrid host: move it from its v1 mount and back.

Hosts with systemd >= 247 are cgroup v2 only; the development machines are hybrid (v1
controllers under /sys/fs/cgroup/<controller>, a v2 mount at /sys/fs/cgroup/unified without
cpu). A controller belongs to one hierarchy at a time, and an unmounted v1 hierarchy with no
child cgroups releases it: after `umount /sys/fs/cgroup/cpu`, cpu shows in the v2 mount's
cgroup.controllers, and `+cpu` in its cgroup.subtree_control gives children cpu.weight and
cpu.max. Back: the children removed, `-cpu`, then the v1 mount again; the kernel frees the v2
side asynchronously, so the mount is retried for a while ("already mounted" at first, fine a
few seconds later). This is machine-global, so it is done only where the v1 cpu hierarchy has
no child cgroups, and undone on exit, on failure, on SIGINT and on SIGTERM.

Tests (tests/agent/test_levers_cgroup.py) and bench/node_slo.py --cgroup-v2 use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from types import FrameType

from turbonode.cgroups import UNIFIED, CgroupError, CpuHierarchy

V1_CPU = "cpu"  # the v1 mount moved: cpu alone (a co-mounted cpu,cpuacct is left alone)
SETTLE_S = 30.0  # how long the kernel may take to free the v2 side for the v1 mount (seen: 3 s)
# A released v1 hierarchy frees its controller at once (ms); one that outlives its unmount (a
# process still holds a file in it, or a mount of it in another mount namespace) never does.
RELEASE_S = 5.0


class CgroupV2Unavailable(CgroupError):
    """The cpu controller cannot be moved here; says why (a reason to skip, not a failure)."""


def _mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """mount point -> (filesystem type, super options) from /proc/self/mountinfo."""
    out = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 3:
                out[fields[4]] = (rfields[0], rfields[2])
    return out


def unavailable(root: str = "/sys/fs/cgroup", mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Why the cpu controller cannot be moved to v2 here, or None if it can."""
    if os.geteuid() != 0:
        return "moving a cgroup controller needs root"
    mounts = _mounts(mountinfo)
    v1, unified = os.path.join(root, V1_CPU), os.path.join(root, UNIFIED)
    if mounts.get(unified, ("",))[0] != "cgroup2":
        return f"no cgroup2 mount at {unified} (not a hybrid host)"
    fstype, options = mounts.get(v1, ("", ""))
    if fstype != "cgroup" or "cpu" not in options.split(",") or "cpuacct" in options.split(","):
        return f"no cgroup v1 cpu controller mounted alone at {v1}"
    children = [e.name for e in os.scandir(v1) if e.is_dir()]
    if children:
        return f"the v1 cpu hierarchy has child cgroups ({', '.join(sorted(children)[:3])}): it cannot release cpu"
    return None


def _listed(path: str, word: str) -> bool:
    with open(path) as f:
        return word in f.read().split()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _run(*cmd: str) -> str | None:
    """None on success, else the command's error."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return None if out.returncode == 0 else (out.stderr.strip() or f"exit {out.returncode}")


def _until(done, what: str, settle_s: float) -> None:
    deadline = time.monotonic() + settle_s
    while (err := done()) is not None:
        if time.monotonic() > deadline:
            raise CgroupError(f"{what}: {err} (for {settle_s:.0f} s)")
        time.sleep(0.5)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like SIGINT, so the `finally` below restores v1 either way."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def cpu_on_v2(root: str = "/sys/fs/cgroup", settle_s: float = SETTLE_S) -> Iterator[CpuHierarchy]:
    """The v2 hierarchy with the cpu controller, for the duration; v1 as it was afterwards.

    Cgroups made below it must be removed before the block ends (the controller cannot leave a
    hierarchy that still has children using it)."""
    if reason := unavailable(root):
        raise CgroupV2Unavailable(reason)
    v1, unified = os.path.join(root, V1_CPU), os.path.join(root, UNIFIED)
    controllers, subtree = os.path.join(unified, "cgroup.controllers"), os.path.join(unified, "cgroup.subtree_control")
    with _terminate_as_interrupt():
        if err := _run("umount", v1):  # nothing changed: busy means a process holds files in it
            raise CgroupV2Unavailable(f"cannot unmount the v1 cpu hierarchy {v1}: {err} (fuser -vm {v1} names who)")
        enabled = False
        try:
            try:
                _until(lambda: None if _listed(controllers, "cpu") else "cpu not listed", controllers, RELEASE_S)
            except CgroupError as exc:
                raise CgroupV2Unavailable(
                    f"the v1 cpu hierarchy outlived its unmount ({exc}): a process holds a file in it, "
                    "or a mount of it in another mount namespace"
                ) from None
            if not _listed(subtree, "cpu"):
                _write(subtree, "+cpu")
                enabled = True
            yield CpuHierarchy(unified, 2)
        finally:
            if enabled:
                with contextlib.suppress(OSError):  # a leftover child keeps it busy: the mount then says so
                    _write(subtree, "-cpu")
            _until(lambda: _run("mount", "-t", "cgroup", "-o", "cpu", "cgroup", v1), f"remounting {v1}", settle_s)
