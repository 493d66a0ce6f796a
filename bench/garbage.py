"""Cyclic garbage inside a process, on demand: the GC fault for bench/detection.py.

A daemon thread keeps a rolling window of cyclic object graphs: graphs survive a few young
collections and then die, so the collector's full (generation 2) passes keep finding
hundreds of thousands of tracked objects to traverse. Those passes stop every thread of the
process (the GIL) for 10-100 ms, like a leaky request handler would. SIGUSR1 starts a burst
of at most `MAX_BURST_S`, SIGUSR2 stops it; the handlers only set flags.
"""

from __future__ import annotations

import collections
import signal
import threading
import time

MAX_BURST_S = 10.0
GRAPH_NODES = 2000
WINDOW = 120


class Garbage:
    def __init__(self):
        self.until = 0.0
        self.event = threading.Event()

    def install(self) -> Garbage:
        signal.signal(signal.SIGUSR1, self._start)
        signal.signal(signal.SIGUSR2, self._stop)
        return self.start()

    def start(self) -> Garbage:
        """The thread, idle until `burst` (without the signals: a test's)."""
        threading.Thread(target=self._run, name="bench-garbage", daemon=True).start()
        return self

    def _start(self, *_):
        self.burst(MAX_BURST_S)

    def _stop(self, *_):
        self.stop()

    def burst(self, seconds: float) -> None:
        """Make garbage for `seconds` (from a signal handler: only flags are set)."""
        self.until = time.monotonic() + seconds
        self.event.set()

    def stop(self) -> None:
        self.until = 0.0

    def _run(self):
        while True:
            self.event.wait()
            self.event.clear()
            window: collections.deque = collections.deque(maxlen=WINDOW)
            while time.monotonic() < self.until:
                nodes = [{} for _ in range(GRAPH_NODES)]
                for i, node in enumerate(nodes):
                    node["next"] = nodes[(i + 1) % GRAPH_NODES]  # a cycle: only the GC frees it
                window.append(nodes)
                time.sleep(0)  # let the worker's threads run between graphs
            window.clear()
