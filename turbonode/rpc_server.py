"""A JSON-RPC 2.0 server on an AF_UNIX stream socket: the transport both daemons share.

The worker's control socket and the agent's status socket speak the same wire contract
(turbonode.jsonrpc); this module is the threaded server around it. Import-light (no torch).
A malformed, oversized or unknown request gets an error and the connection carries on.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import socketserver
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import jsonrpc
from .errors import TurbonodeError

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
# A client gets this long to send each request whole and to take each answer: a local caller
# needs milliseconds; an idle or trickling one (a byte every few seconds) loses its connection.
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
# Bursts of callers queue here while the accept loop catches up (socketserver's default is 5, and
# a full AF_UNIX backlog fails connect() at once with EAGAIN); the kernel caps it at somaxconn.
LISTEN_BACKLOG = 128


class SocketInUse(TurbonodeError):
    """Another live process already serves the socket, or the path is not a socket."""


def prepare_socket_path(path: str, owner: str = "server") -> None:
    """Create the directory; remove a stale socket a dead `owner` left, but never a live one.
    Raises TurbonodeError naming the path that failed and why."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise TurbonodeError(
            f"cannot create {exc.filename or directory} for the {owner} socket {path}: {exc.strerror or exc}"
        ) from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TurbonodeError(f"cannot use {path} for the {owner} socket: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            try:
                os.unlink(path)  # nobody listens: a stale socket from a process that died
            except OSError as exc:
                raise TurbonodeError(f"cannot remove the stale {owner} socket {path}: {exc.strerror or exc}") from None
            return
    raise SocketInUse(f"another {owner} is already serving {path}")


def _chgrp(path: str, group: str | None) -> None:
    if not group:
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.info("group %r does not exist; %s stays owned by the process's group", group, path)
        return
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        log.warning("cannot give %s to group %r (not root and not a member)", path, group)


class _LineSocket:
    """Reads request lines from a connected socket, each within a deadline (jsonrpc.LineReader).

    A per-read timeout alone lets a client that sends a byte now and then hold its thread
    forever; the deadline bounds the whole line however the bytes trickle in.
    """

    CHUNK = 64 * 1024

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline = 0.0  # monotonic; set before each request
        self._buf = bytearray()

    def readline(self, size: int = -1, /) -> bytes:
        limit = size if size >= 0 else sys.maxsize
        while True:
            newline = self._buf.find(b"\n", 0, limit)
            if newline >= 0:
                return self._take(newline + 1)
            if len(self._buf) >= limit:
                return self._take(limit)
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("request not complete before the deadline")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(self.CHUNK)
            if not chunk:
                return self._take(len(self._buf))
            self._buf += chunk

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


class _Handler(socketserver.BaseRequestHandler):
    server: UnixRpcServer

    def handle(self) -> None:
        reader = _LineSocket(self.request)
        answer: jsonrpc.JsonObject | None
        while True:
            try:
                line = self._next_line(reader)
            except jsonrpc.RpcError as exc:  # oversized: refused, and the connection goes on
                answer = jsonrpc.error_response(None, exc.code, exc.message)
            except OSError:  # past the deadline, closed to make room, or the client went away
                return
            else:
                if line is None:
                    return
                if not line.strip():
                    continue
                answer = jsonrpc.dispatch(self.server.handlers, line)
            if answer is not None and not self._send(answer):
                return

    def _next_line(self, reader: _LineSocket) -> bytes | None:
        reader.deadline = time.monotonic() + self.server.request_timeout
        self.server.waiting(self.request, True)
        try:
            return jsonrpc.read_line(reader)
        finally:
            self.server.waiting(self.request, False)

    def _send(self, obj: jsonrpc.JsonObject) -> bool:
        try:
            self.request.settimeout(self.server.request_timeout)  # a client that never reads is dropped too
            self.request.sendall(jsonrpc.encode(obj))
        except OSError:
            return False
        return True


class UnixRpcServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Serves `handlers` (method -> callable taking keyword params) on `path`, one thread per client.

    At most `max_connections` clients at once. When all are taken, a new client gets the slot of
    the one that has waited longest for its request to arrive (an idle or slow client), or, if
    every client is being answered, an error. A client gets `request_timeout` seconds to send
    each request whole (from connecting or from the previous answer) and to take each answer.
    """

    daemon_threads = True
    block_on_close = False
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        path: str,
        handlers: dict[str, Callable[..., Any]],
        *,
        owner: str = "server",
        group: str | None = None,
        mode: int = SOCKET_MODE,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.path = path
        self.handlers = handlers
        self.owner = owner
        self.max_connections = max_connections
        self.request_timeout = REQUEST_TIMEOUT_S
        self._lock = threading.Lock()
        self._open = 0  # connections served now, those being closed to make room included
        self._waiting: dict[socket.socket, float] = {}  # connection -> since when it waits for a request
        self._evicted: set[socket.socket] = set()
        prepare_socket_path(path, owner)
        super().__init__(path, _Handler, bind_and_activate=False)
        try:
            self.server_bind()
            os.chmod(path, mode)
            _chgrp(path, group)
            self.server_activate()
        except OSError as exc:
            self.server_close()
            raise TurbonodeError(f"cannot listen on {path}: {exc.strerror or exc}") from None
        self._thread: threading.Thread | None = None

    def waiting(self, conn: socket.socket, waiting: bool) -> None:
        """A handler says it waits for a request (True) or is answering one (False)."""
        with self._lock:
            if waiting and conn not in self._evicted:
                self._waiting[conn] = time.monotonic()
            else:
                self._waiting.pop(conn, None)

    def _admit(self) -> bool:
        """Take a slot, making room by closing the longest-waiting connection if need be."""
        with self._lock:
            if self._open - len(self._evicted) >= self.max_connections:
                if not self._waiting:
                    return False
                victim = min(self._waiting, key=self._waiting.__getitem__)
                del self._waiting[victim]
                self._evicted.add(victim)
                try:  # wakes its handler's recv with EOF; the handler then frees the slot
                    victim.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._open += 1
            return True

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit():
            try:
                message = f"too many connections (max {self.max_connections}), all busy"
                request.send(jsonrpc.encode(jsonrpc.error_response(None, jsonrpc.INTERNAL_ERROR, message)))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1
                self._evicted.discard(request)
                self._waiting.pop(request, None)

    def start(self) -> UnixRpcServer:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name=f"turbonode-{self.owner}-rpc", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever: only if it runs
            self.shutdown()
            self._thread.join(5)
        self.server_close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
