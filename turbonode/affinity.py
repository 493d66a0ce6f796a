"""Pinning a process, every thread of it, to a set of CPUs."""

from __future__ import annotations

import contextlib
import os

from .errors import TurbonodeError


def pin_cpus(cpus: frozenset[int], procfs: str = "/proc") -> None:
    """Run this process (and the processes it starts, which inherit it) on `cpus` only: a worker
    of `[workers.<name>] cpus` (render/front/daemon.py: several workers on one node then never share a
    CPU, and its default threads follow from the pinned set, render/cpu_threads.py), a sandbox
    node's client beside its worker (sandbox/loadgen.py). Empty: leave the affinity alone.
    Affinity belongs to a thread, and sched_setaffinity(0) sets the caller's only: every thread
    the process already has is pinned too (one started at import, a plugin's, bench/garbage.py's
    GC storm), or it would keep running on the other workers' CPUs."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # EINVAL: none of them online here
        here = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        raise TurbonodeError(
            f"cannot run on CPUs {sorted(cpus)}: {exc.strerror or exc} (this host's: {here})"
        ) from None
    for tid in os.listdir(f"{procfs}/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
