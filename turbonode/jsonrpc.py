"""JSON-RPC 2.0 over a line-oriented AF_UNIX stream socket (docs/design.md, control protocol).

One JSON object per line; a line longer than MAX_REQUEST_BYTES is refused without being
read into memory whole. This module holds the wire contract both sides share: the server
(render.front.control_server) and the client (ControlClient) use it.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import ControlError

JsonObject = dict[str, Any]


class LineReader(Protocol):
    """A binary file read line by line (a socket's makefile("rb"), a request handler's rfile)."""

    def readline(self, size: int = -1, /) -> bytes: ...


MAX_REQUEST_BYTES = 64 * 1024
DEFAULT_SOCKET = "/run/turbonode/worker.sock"
# A full listen backlog makes connect() on an AF_UNIX socket fail at once with EAGAIN (there is
# no SYN retry as with TCP): the client retries with this backoff within its timeout.
CONNECT_RETRY_S = (0.005, 0.1)  # first wait, longest wait

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000  # the first of the implementation-defined codes: the server cannot serve this now
# What a worker answers (SERVER_ERROR) to every method while it loads its model: its callers show it as loading.
WORKER_LOADING = "the worker is loading its model"


class RpcError(Exception):
    """Raised by a handler to answer with a JSON-RPC error object."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


def error_response(req_id: Any, code: int, message: str, data: Any = None) -> JsonObject:
    err: JsonObject = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "id": req_id, "error": err}


def result_response(req_id: Any, result: Any) -> JsonObject:
    return {"jsonrpc": "2.0", "id": req_id, "result": result}


def encode(obj: JsonObject) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


@dataclass
class Request:
    id: Any
    method: str
    params: JsonObject | list[Any]
    notification: bool


def parse_request(line: bytes) -> Request | JsonObject:
    """Parse one line; returns a Request or a ready error response."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        return error_response(None, PARSE_ERROR, f"parse error: {exc}")
    except RecursionError:  # the decoder recurses per nesting level; a deep request must not escape
        return error_response(None, PARSE_ERROR, "parse error: nested too deeply")
    if not isinstance(obj, dict):
        return error_response(None, INVALID_REQUEST, "invalid request: expected a JSON object")
    req_id = obj.get("id")
    if obj.get("jsonrpc") != "2.0":
        return error_response(req_id, INVALID_REQUEST, "invalid request: 'jsonrpc' must be \"2.0\"")
    method = obj.get("method")
    if not isinstance(method, str):
        return error_response(req_id, INVALID_REQUEST, "invalid request: 'method' must be a string")
    params = obj.get("params", {})
    if not isinstance(params, (dict, list)):
        return error_response(req_id, INVALID_REQUEST, "invalid request: 'params' must be an object or array")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, (str, int))):
        return error_response(None, INVALID_REQUEST, "invalid request: 'id' must be a string or integer")
    return Request(req_id, method, params, "id" not in obj)


def dispatch(handlers: Mapping[str, Callable[..., Any]], line: bytes) -> JsonObject | None:
    """Handle one request line with `handlers` (method -> callable taking keyword params).

    Returns the response object, or None for a notification. Never raises for bad input.
    """
    req = parse_request(line)
    if isinstance(req, dict):
        return req
    handler = handlers.get(req.method)
    if handler is None:
        resp = error_response(req.id, METHOD_NOT_FOUND, f"method not found: {req.method}")
    else:
        try:
            result = handler(*req.params) if isinstance(req.params, list) else handler(**req.params)
            resp = result_response(req.id, result)
        except RpcError as exc:
            resp = error_response(req.id, exc.code, exc.message, exc.data)
        except TypeError as exc:
            resp = error_response(req.id, INVALID_PARAMS, f"invalid params for {req.method}: {exc}")
        except Exception as exc:  # a handler bug must not take the server down
            resp = error_response(req.id, INTERNAL_ERROR, f"internal error in {req.method}: {exc}")
    return None if req.notification else resp


def read_line(sock_file: LineReader, limit: int = MAX_REQUEST_BYTES) -> bytes | None:
    """Read one line of at most `limit` bytes from a binary file; None at EOF.

    Raises RpcError(INVALID_REQUEST) when the line is longer than the limit; the rest of
    that line is discarded so the connection stays usable.
    """
    line: bytes = sock_file.readline(limit + 1)
    if not line:
        return None
    if len(line) > limit and not line.endswith(b"\n"):
        while True:  # drain the oversized line in bounded chunks
            rest = sock_file.readline(limit)
            if not rest or rest.endswith(b"\n"):
                break
        raise RpcError(INVALID_REQUEST, f"request larger than {limit} bytes refused")
    return line


class ControlClient:
    """Synchronous client for the worker's control socket (used by the agent and turboctl)."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 2.0, peer: str = "worker"):
        self.path, self.timeout, self.peer = path, timeout, peer  # peer names the server in errors
        self._next_id = 0

    def call(self, method: str, **params: Any) -> Any:
        self._next_id += 1
        req = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                self._connect(sock)
                sock.sendall(encode(req))
                with sock.makefile("rb") as f:
                    line = f.readline(16 * MAX_REQUEST_BYTES)
        except FileNotFoundError:
            raise ControlError(
                f"{self.peer} control socket {self.path} does not exist (is the {self.peer} running?)"
            ) from None
        except PermissionError:
            raise ControlError(f"no permission to connect to {self.path} (need the turbonode group or root)") from None
        except BlockingIOError:
            raise ControlError(
                f"{self.peer} control socket {self.path} is busy: its listen backlog stayed full for {self.timeout:g} s"
            ) from None
        except ConnectionRefusedError:
            raise ControlError(
                f"{self.peer} control socket {self.path} refused the connection ({self.peer} not running?)"
            ) from None
        except OSError as exc:
            raise ControlError(f"control socket {self.path}: {exc.strerror or exc}") from None
        if not line:
            raise ControlError(f"{self.peer} closed {self.path} without answering {method}")
        try:
            resp = json.loads(line)
        except ValueError as exc:
            raise ControlError(f"{self.peer} sent an unreadable answer to {method}: {exc}") from None
        if "error" in resp:
            err = resp["error"]
            raise ControlError(f"{method}: {err.get('message')}", err.get("code"), err.get("data"))
        return resp.get("result")

    def _connect(self, sock: socket.socket) -> None:
        """connect(), retried while the server's listen backlog is full (EAGAIN), up to the timeout."""
        deadline = time.monotonic() + self.timeout
        wait, longest = CONNECT_RETRY_S
        while True:
            try:
                sock.connect(self.path)
                return
            except BlockingIOError:
                if time.monotonic() + wait > deadline:
                    raise
            time.sleep(wait)
            wait = min(2 * wait, longest)
