"""Interrupting a sandbox run (the demo) reliably.

The CLI's SIGINT/SIGTERM handler raises KeyboardInterrupt and sets an Event. A library may
swallow the exception (pyroute2's netlink code has bare excepts), so the run checks the
Event at every step boundary as well. A bench script, which has no such handler, exits on
those signals through its `with` blocks (`exit_on_signals`), and what it started is `Closing`:
closed on the way out, also when starting it failed part way.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Self


class Closing:
    """A context manager over `start` and `close`: `close` also runs when `start` raises, so
    what it had made by then is removed."""

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def exit_on_signals() -> None:
    """SIGTERM and SIGINT end the process with SystemExit(128 + signal), which unwinds every
    `with`: a stopped bench run removes what it made."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))


def checkpoint(stop: threading.Event | None) -> None:
    """Raise KeyboardInterrupt if `stop` was set."""
    if stop is not None and stop.is_set():
        raise KeyboardInterrupt
