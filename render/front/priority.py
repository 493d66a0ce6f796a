"""The front yields the CPU to its engine: a nice value for every thread of the front process.

A worker's two processes share the CPUs it may use (one, where `cpus` pins it). A turbo request's
time is mostly the engine's denoising steps; the front's threads (HTTP, the control socket, and
anything that runs beside them: a leaky handler's garbage and the collections it causes) must not
take the engine's share at the same weight. Nice is per thread on Linux: every thread that exists
now is reniced (raising one's own nice needs no privilege), and threads started later inherit the
value of the thread that starts them. The engine process, spawned before, keeps its own, and so
does the thread of the front's full collections (render/front/full_collections.py).
`worker.front_nice`'s default yields only where the two share a single CPU (front_nice below).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

from turbonode.config.worker import FRONT_NICE_AUTO, SHARED_CPU_NICE

log = logging.getLogger(__name__)


def front_nice(configured: int, cpus: int) -> int:
    """The nice the front takes: `configured`, or (FRONT_NICE_AUTO) SHARED_CPU_NICE where the
    worker may use `cpus` = 1 CPU, which its front and engine then share, else 0."""
    if configured != FRONT_NICE_AUTO:
        return configured
    return SHARED_CPU_NICE if cpus == 1 else 0


def yield_to_engine(nice: int, procfs: str = "/proc", keep: Collection[int] = ()) -> list[str]:
    """Raise every thread of this process but those in `keep` (thread ids) to at least `nice`; the
    problems, one line each."""
    if nice <= 0:
        return []
    task = os.path.join(procfs, str(os.getpid()), "task")
    try:
        tids = [int(t) for t in os.listdir(task)]
    except OSError as exc:
        return [f"cannot list this process's threads in {task}: {exc.strerror or exc}"]
    problems = []
    for tid in tids:
        if tid in keep:
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            problems.append(f"cannot renice thread {tid} to {nice}: {exc.strerror or exc}")
    for problem in problems:
        log.warning("%s", problem)
    return problems
