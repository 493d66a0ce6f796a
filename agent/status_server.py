"""The agent's own JSON-RPC status socket (turboctl status reads it).

Same wire contract as the worker's control socket (turbonode.jsonrpc): one request per line,
bounded line length, standard error codes. One thread per connection; handlers only read a
snapshot the main loop publishes.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
from typing import Any, Callable

from turbonode.errors import TurbonodeError
from turbonode.jsonrpc import RpcError, dispatch, encode, error_response, read_line


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            try:
                line = read_line(self.rfile)
            except RpcError as exc:
                self.wfile.write(encode(error_response(None, exc.code, exc.message)))
                continue
            if line is None:
                return
            resp = dispatch(self.server.handlers, line)
            if resp is not None:
                self.wfile.write(encode(resp))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class StatusServer:
    def __init__(self, path: str, handlers: dict[str, Callable[..., Any]], mode: int = 0o660):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            if _answers(path):
                raise TurbonodeError(f"another agent is already serving {path}")
            os.unlink(path)   # a stale socket a dead agent left
        try:
            self.server = _Server(path, _Handler)
        except OSError as exc:
            raise TurbonodeError(f"cannot listen on {path}: {exc.strerror or exc}") from None
        os.chmod(path, mode)
        self.server.handlers = handlers
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                       name="agent-status", daemon=True)

    def start(self) -> "StatusServer":
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread.is_alive():   # shutdown() waits for serve_forever: only if it runs
            self.server.shutdown()
        self.server.server_close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
