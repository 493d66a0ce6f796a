"""Hand the heap's free pages back to the kernel now and then (glibc's malloc_trim).

A worker allocates and frees tensors of many sizes at every step; glibc keeps what is freed in
its arenas, and a few long-lived blocks (the records of finished jobs, caches) scattered among
them keep it from shrinking the heap, so the engine's RSS grows with every request served
(measured: ~100 KB per request on the tiny model, 2 GB after ~7 minutes of node_slo load, the
node's memory cgroup then OOM-killed it). malloc_trim(0) returns the free pages inside the
arenas too (madvise), without moving anything; it takes milliseconds, so it runs at most every
PERIOD_S from the engine's loop. Where the C library has no malloc_trim (not glibc), nothing runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

PERIOD_S = 5.0

_malloc_trim: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


class HeapTrim:
    def __init__(self, clock: Callable[[], float], period_s: float = PERIOD_S):
        self.clock, self.period_s = clock, period_s
        self._last = clock()
        self.trims = 0

    @property
    def available(self) -> bool:
        return _malloc_trim is not None

    def maybe(self) -> bool:
        """Trim if the period has passed since the last one; whether it trimmed."""
        now = self.clock()
        if _malloc_trim is None or now - self._last < self.period_s:
            return False
        self._last = now
        _malloc_trim(0)
        self.trims += 1
        return True
