"""Closing the HTTP listener without resetting the clients in its accept queue.

close() on a listening socket resets every connection the kernel has completed but the server has
not accepted yet: those clients connected, sent their request and read a reset, which they cannot
tell from a request cut off half-way. The event loop accepts only when it comes round to the
listener, so on a busy node a turn's worth of connections (milliseconds) can sit in the queue when
the server closes it. At stop the front instead accepts what is queued and closes the listener
with no await in between, then serves what it took (503 draining): only a handshake completing in
the microseconds between the last accept and the close is reset.

A socket filter dropping SYNs before the close would leave no such window, but this kernel
refuses SO_ATTACH_FILTER (EPERM) to a process without capabilities, as the worker's unit is.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


def take_queue(sock: socket.socket) -> list[socket.socket]:
    """Accept every connection the kernel has queued on the non-blocking listener `sock`."""
    taken: list[socket.socket] = []
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return taken
        except ConnectionAbortedError:  # the client gave up while queued: the next one
            continue
        except OSError as exc:  # out of file descriptors: the rest are reset at the close
            log.warning("could not accept the queued connections before closing the listener: %s", exc)
            return taken
        taken.append(conn)
