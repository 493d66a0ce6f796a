"""A sync job's answer, written by the engine process on the client's own connection.

The front hands the accepted connection to the engine process with the job (its descriptor over a
SOCK_SEQPACKET pair, SCM_RIGHTS: render/front/remote_engine.py); at the job's end the engine writes
the whole HTTP response there itself, so the answer needs nothing of the front's process. In a GC
storm in the front every turn of its event loop waits for a collection (bench/worker_turbo.py:
the worker paused ~82 % of the time); the answer no longer waits for one. The connection then
closes (`Connection: close`): the front, told by the job's end, lets go of its side.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

HAND_OFF_TIMEOUT_S = 5.0  # the front sends the descriptor before the submit: it is already there
WRITE_TIMEOUT_S = 30.0  # a client that takes no byte this long has gone


def receive_connection(channel: socket.socket) -> socket.socket:
    """The connection the front sent with the submit now being served (OSError if none came)."""
    channel.settimeout(HAND_OFF_TIMEOUT_S)
    _, fds, _, _ = socket.recv_fds(channel, 1, 1)
    if not fds:
        raise OSError("the front's submit came without its connection")
    return socket.socket(fileno=fds[0])


def http_answer(answer: dict, headers: Mapping[str, str]) -> bytes:
    """The whole response, as the front's aiohttp would send it (json.dumps' body), closing."""
    body = json.dumps(answer).encode()
    head = ["HTTP/1.1 200 OK", "Content-Type: application/json; charset=utf-8", f"Content-Length: {len(body)}"]
    head += ["Connection: close", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def write_answer(conn: socket.socket, answer: bytes) -> bool:
    """Send it all, end the connection's sending side and close this process's descriptor; whether
    it all went (False: the client went away or stopped reading)."""
    try:
        conn.settimeout(WRITE_TIMEOUT_S)  # the descriptor is the front's non-blocking one
        conn.sendall(answer)
        # the front still holds its own descriptor of this socket: closing ours alone sends no FIN,
        # and a client reading to the close (Connection: close) would wait for the front's next turn
        conn.shutdown(socket.SHUT_WR)
        return True
    except OSError as exc:
        log.info("a sync answer was not delivered: %s", exc)
        return False
    finally:
        conn.close()
