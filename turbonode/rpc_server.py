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
import threading
from collections.abc import Callable
from typing import Any

from . import jsonrpc
from .errors import TurbonodeError

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
IDLE_TIMEOUT_S = 60.0  # a silent client does not hold a thread forever
MAX_CONNECTIONS = 32


class SocketInUse(TurbonodeError):
    """Another live process already serves the socket, or the path is not a socket."""


def prepare_socket_path(path: str, owner: str = "server") -> None:
    """Create the directory; remove a stale socket a dead `owner` left, but never a live one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale socket from a process that died
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


class _Handler(socketserver.StreamRequestHandler):
    timeout = IDLE_TIMEOUT_S

    def handle(self) -> None:
        handlers = self.server.handlers  # type: ignore[attr-defined]
        while True:
            try:
                line = jsonrpc.read_line(self.rfile)
            except jsonrpc.RpcError as exc:
                self._send(jsonrpc.error_response(None, exc.code, exc.message))
                continue
            except (OSError, ValueError):  # idle timeout or the client went away
                return
            if line is None:
                return
            if not line.strip():
                continue
            resp = jsonrpc.dispatch(handlers, line)
            if resp is not None and not self._send(resp):
                return

    def _send(self, obj: jsonrpc.JsonObject) -> bool:
        try:
            self.wfile.write(jsonrpc.encode(obj))
            self.wfile.flush()
        except OSError:
            return False
        return True


class UnixRpcServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Serves `handlers` (method -> callable taking keyword params) on `path`, one thread per client."""

    daemon_threads = True
    block_on_close = False

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
        self._slots = threading.BoundedSemaphore(max_connections)
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

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(
                    jsonrpc.encode(
                        jsonrpc.error_response(
                            None, jsonrpc.INTERNAL_ERROR, f"too many connections (max {self.max_connections})"
                        )
                    )
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

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
