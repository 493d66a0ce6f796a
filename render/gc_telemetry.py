"""Time every garbage collection through `gc.callbacks` (generation and pause).

A full collection in a process holding a large model can pause every thread for tens of
milliseconds; the agent reads these pauses from `status` to tell GC stalls from network
stalls. The callback runs inside the collector, so it takes no locks and allocates little:
it appends to a bounded deque (atomic in CPython) and bumps counters.
"""

from __future__ import annotations

import collections
import gc
import itertools
import time
from collections.abc import Callable


class GcMonitor:
    def __init__(
        self,
        keep: int = 512,
        observe: Callable[[int, float], None] | None = None,
        clock=time.perf_counter,
        wall=time.time,
    ):
        self.pauses: collections.deque = collections.deque(maxlen=keep)
        self.collections_total = 0
        self.pause_seconds_total = 0.0
        self._seq = itertools.count(1)
        self._observe = observe
        self._clock, self._wall = clock, wall
        self._started: float | None = None
        self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        pause = self._clock() - self._started
        self._started = None
        generation = info.get("generation", -1)
        self.collections_total += 1
        self.pause_seconds_total += pause
        self.pauses.append({"seq": next(self._seq), "generation": generation, "pause_s": pause, "at": self._wall()})
        if self._observe is not None:
            self._observe(generation, pause)

    def install(self) -> GcMonitor:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    @property
    def last_seq(self) -> int:
        pauses = list(self.pauses)
        return pauses[-1]["seq"] if pauses else 0

    def since(self, seq: int, limit: int = 128) -> list[dict]:
        """Pauses with seq > `seq`, newest `limit` of them, oldest first."""
        newer = [p for p in list(self.pauses) if p["seq"] > seq]
        return newer[-limit:]


def freeze_after_load() -> None:
    """Collect once, then move every surviving object (the model) out of GC's reach.

    Later collections then never traverse the model's millions of objects, which keeps
    gen-2 pauses short for the life of the worker.
    """
    gc.collect()
    gc.freeze()
