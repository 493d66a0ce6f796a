"""Time every garbage collection through `gc.callbacks` (generation and pause).

A full collection in a process holding a large model can pause every thread for tens of
milliseconds; the agent reads these pauses from `status`, and waits for them with `events`, to
tell GC stalls from network stalls. The callback runs inside the collector, in whatever thread
allocated, so it allocates little and takes no lock the interrupted code could hold: it appends
to a bounded deque (atomic in CPython), bumps counters, wakes waiters through queue.SimpleQueue,
whose put() is reentrant, and calls `observe` (render/front/metrics.py makes every series of its
histogram up front, so an observation only takes a lock around a float add, under which
nothing allocates and so no collection starts).
"""

from __future__ import annotations

import collections
import gc
import itertools
import queue
import threading
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
        # (queue, threshold) of each thread in wait_for_pause: replaced whole, never mutated, so the
        # callback iterates a consistent tuple without a lock
        self._waiters: tuple[tuple[queue.SimpleQueue, float], ...] = ()
        self._waiters_lock = threading.Lock()

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        pause = self._clock() - self._started
        self._started = None
        self.record(info.get("generation", -1), pause)

    def record(self, generation: int, pause: float) -> None:
        """One collection's pause: this process's (from the callback) or the engine process's."""
        self.collections_total += 1
        self.pause_seconds_total += pause
        seq = next(self._seq)
        self.pauses.append({"seq": seq, "generation": generation, "pause_s": pause, "at": self._wall()})
        for waiter, longer_than in self._waiters:
            if pause > longer_than:
                waiter.put(seq)
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

    def longest_since(self, seq: int) -> float:
        """The longest pause with seq > `seq` still kept, 0 if none."""
        return max((p["pause_s"] for p in list(self.pauses) if p["seq"] > seq), default=0.0)

    def wait_for_pause(self, seq: int, longer_than: float, timeout: float) -> bool:
        """Block until a pause longer than `longer_than` with seq > `seq` exists, at most `timeout`
        seconds; whether one does. Any thread, any number of them at once."""
        waiter: tuple[queue.SimpleQueue, float] = (queue.SimpleQueue(), longer_than)
        with self._waiters_lock:
            self._waiters = (*self._waiters, waiter)
        try:  # registered first, then checked: a pause in between is in the deque or in the queue
            if self.longest_since(seq) > longer_than:
                return True
            try:
                waiter[0].get(timeout=max(0.0, timeout))
            except queue.Empty:
                return False
            return True
        finally:
            with self._waiters_lock:
                self._waiters = tuple(w for w in self._waiters if w is not waiter)


def freeze_after_load() -> None:
    """Collect once, then move every surviving object (the model) out of GC's reach.

    Later collections then never traverse the model's millions of objects, which keeps
    gen-2 pauses short for the life of the worker.
    """
    gc.collect()
    gc.freeze()
