"""The front's garbage collections, kept off turbo's request path.

A collection stops every thread of the process (the GIL) for as long as it traverses, and CPython
starts one in whichever thread allocates, at any moment: inside a turbo request's handling as
likely as anywhere. Where something in the front makes cyclic garbage fast (bench/garbage.py's
storm stands for a leaky handler), full collections come back to back and turbo's time in the
front grows from tens of milliseconds to a second at p99 (bench/node_slo.py, cell gc, two
workers). So once loaded the front turns automatic collection off (gc.disable, after
freeze_after_load) and its event loop collects instead, generation by generation as the
thresholds say (gc.get_count against gc.get_threshold, as CPython decides), whenever no request
of the protected tier is being handled; and regardless once `max_defer_s` has passed since the
last collection, so a stream of turbo requests cannot grow memory without bound. Every collection
is still timed (render/gc_telemetry.py: gc.callbacks fire for gc.collect too): the agent sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator


def due_generation(count: tuple[int, int, int], threshold: tuple[int, int, int]) -> int | None:
    """The generation CPython would collect at these counts, or None (pure)."""
    if threshold[0] == 0 or count[0] <= threshold[0]:
        return None
    return next(gen for gen in (2, 1, 0) if gen == 0 or count[gen] > threshold[gen])


class GcSchedule:
    def __init__(self, interval_s: float = 0.01, max_defer_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.max_defer_s, self.clock = interval_s, max_defer_s, clock
        self.protected = 0  # protected-tier requests being handled now
        self.last = clock()  # when the last collection ran
        self.deferred = 0  # ticks a due collection waited for a protected request
        self.forced = 0  # collections run during a protected request (max_defer_s passed)

    @contextlib.contextmanager
    def protecting(self) -> Iterator[None]:
        """Around the handling of one protected-tier request."""
        self.protected += 1
        try:
            yield
        finally:
            self.protected -= 1

    def tick(self) -> int | None:
        """Collect what is due unless a protected request is being handled (and max_defer_s has
        not passed); the generation collected, or None."""
        gen = due_generation(gc.get_count(), gc.get_threshold())
        if gen is None:
            return None
        if self.protected:
            if self.clock() - self.last < self.max_defer_s:
                self.deferred += 1
                return None
            self.forced += 1
        gc.collect(gen)
        self.last = self.clock()
        return gen

    async def run(self) -> None:
        """Collect from the event loop, automatic collection off, until cancelled."""
        gc.disable()
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.tick()
        finally:
            gc.enable()
