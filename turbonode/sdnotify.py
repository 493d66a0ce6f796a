"""systemd's notification protocol (sd_notify) without libsystemd.

A no-op where NOTIFY_SOCKET is unset, so daemons call it unconditionally.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send e.g. 'READY=1', 'STOPPING=1', 'WATCHDOG=1', 'STATUS=...'; True if sent."""
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Never block the daemon: a listener that is not reading (its queue holds only
            # net.unix.max_dgram_qlen datagrams) makes this fail instead of stalling the caller.
            sock.setblocking(False)
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when no watchdog is set."""
    environ = env if env is not None else os.environ
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
