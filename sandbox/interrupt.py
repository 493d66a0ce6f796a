"""Interrupting a sandbox run (the demo) reliably.

The CLI's SIGINT/SIGTERM handler raises KeyboardInterrupt and sets an Event. A library may
swallow the exception (pyroute2's netlink code has bare excepts), so the run checks the
Event at every step boundary as well.
"""

from __future__ import annotations

import threading


def checkpoint(stop: threading.Event | None) -> None:
    """Raise KeyboardInterrupt if `stop` was set."""
    if stop is not None and stop.is_set():
        raise KeyboardInterrupt
