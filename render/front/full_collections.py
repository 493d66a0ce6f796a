"""The front's full (generation 2) garbage collections, out of band: not while turbo is in the front.

CPython starts a collection in whichever thread allocates past a threshold, and a full one holds
the GIL until it has traversed every tracked object. In a front whose heap churns (a leaky
handler; bench/garbage.py's storm) full passes of tens of milliseconds come one after another,
and at the front's nice, beside its busy engine, each lasts about four times as long in wall
time: a turbo request arriving meanwhile waits at every turn of the GIL (two workers, worker a
in its own storm: the front's share of turbo's p99 487 ms against 74 idle, docs/worker.md).

Young collections stay automatic: they traverse only new objects. Full ones are taken from
CPython (threshold 2 out of reach) and run here, in a thread of their own, once they are due
(as many young generation-1 collections as CPython's own threshold 2 counts: the young
collection that makes one due wakes the thread), at the first moment no turbo request is in the
front (from its admission to its end: `hold`, `release`), and at the latest `most_deferred_s`
after they fell due or once `most_deferred_due` times the young collections that made them due
have happened, which bounds what a storm piles up meanwhile: a storm with a CPU of its own makes
in a second of turbo several times the garbage of a pass (one worker on two CPUs, seed 33: `gc`
1.47x its idle p99 with the time bound alone, against 1.07x on CPython's schedule). The thread
keeps the nice it was started with when the front yields to its engine (render/front/priority.py):
a pass holds every thread of the front, and it runs while no turbo job is in the worker, so it
finishes at the engine's weight, at lower tiers' expense, not turbo's.
CPython also skips a due full pass while its old generation has grown by less than a quarter;
Python cannot read that count, and over the heap frozen after the load (render/gc_telemetry.py)
such a pass is short. An interpreter whose collector has no threshold 2 (an incremental one
reports 0) keeps its own schedule: `start` then leaves it alone and says so.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

OUT_OF_REACH = 2**31 - 1  # threshold 2: CPython never starts a full collection itself
MOST_DEFERRED_S = 1.0  # a due full pass waits for turbo at most this long...
MOST_DEFERRED_DUE = 2  # ...and until its count is this many times the threshold (what the pass traverses)
QUIET, OVERDUE = "quiet", "overdue"  # why a full pass ran: no turbo in the front, or it waited its most
RAN_WHEN = (QUIET, OVERDUE)


class FullCollections:
    """Out-of-band full collections of this process; `hold`/`release` run on the event loop."""

    def __init__(
        self,
        most_deferred_s: float = MOST_DEFERRED_S,
        most_deferred_due: int = MOST_DEFERRED_DUE,
        collect: Callable[[int], object] = gc.collect,
        counts: Callable[[], tuple[int, int, int]] = gc.get_count,
        on_run: Callable[[str], None] | None = None,
    ):
        self.most_deferred_s, self.most_deferred_due = most_deferred_s, most_deferred_due
        self._collect, self._counts, self._on_run = collect, counts, on_run
        self._held = 0  # turbo requests in the front; changed on the event loop only
        self._stopped = threading.Event()
        # the thread's wake-ups: a young collection with a full one due, the last release, stop.
        # SimpleQueue's put() is reentrant: safe in a gc callback, which may run in any thread.
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._woken = False  # the callback has one queued: it queues one at a time
        self._thread: threading.Thread | None = None
        self._thresholds: tuple[int, int, int] | None = None
        self.due_after = 0

    def thread_ids(self) -> tuple[int, ...]:
        """Its thread's id, once started (the front's renice leaves it alone)."""
        tid = self._thread.native_id if self._thread is not None else None
        return (tid,) if tid is not None else ()

    def start(self) -> bool:
        """Take full collections from CPython; False (logged) where its collector has no threshold 2."""
        t0, t1, t2 = gc.get_threshold()
        if t2 <= 0 or t0 <= 0:
            log.info("full collections keep CPython's schedule: its thresholds are %s", (t0, t1, t2))
            return False
        self._thresholds, self.due_after = (t0, t1, t2), t2
        gc.set_threshold(t0, t1, OUT_OF_REACH)
        gc.callbacks.append(self._collected)
        self._thread = threading.Thread(target=self._run, name="full-gc", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """CPython's schedule back; a pass already due runs now."""
        if self._thread is None:
            return
        gc.callbacks.remove(self._collected)
        self._stopped.set()
        self._wake.put(None)
        self._thread.join()
        self._thread = None
        assert self._thresholds is not None
        gc.set_threshold(*self._thresholds)

    def hold(self) -> None:
        """A turbo request entered the front: due passes wait (within their bounds)."""
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if self._held == 0:
            self._wake.put(None)

    def due(self, times: int = 1) -> bool:
        """CPython would have started a full pass (its `count > threshold`; `times` the threshold:
        long ago), were it not out of reach."""
        return self._counts()[2] > self.due_after * times

    def _collected(self, phase: str, info: dict) -> None:
        """gc's callback, in whatever thread collected: a young collection that made a full one due
        wakes the thread (it allocates nothing and takes no lock)."""
        if phase == "stop" and info["generation"] < 2 and not self._woken and self.due():
            self._woken = True
            self._wake.put(None)

    def _run(self) -> None:
        while True:
            self._wake.get()
            self._woken = False
            if self._stopped.is_set():
                return
            if self.due():  # else a wake-up that a pass meanwhile answered
                self.run_due()

    def run_due(self, clock: Callable[[], float] = time.monotonic) -> str:
        """Wait for no turbo in the front, within the bounds, then collect everything."""
        deadline = clock() + self.most_deferred_s
        while self._held and not self.due(self.most_deferred_due) and not self._stopped.is_set():
            left = deadline - clock()
            if left <= 0:
                break
            with contextlib.suppress(queue.Empty):
                self._wake.get(timeout=left)
            self._woken = False
        why = OVERDUE if self._held else QUIET
        self._collect(2)
        if self._on_run is not None:
            self._on_run(why)
        return why
