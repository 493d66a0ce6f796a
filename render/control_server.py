"""The worker's control socket: JSON-RPC 2.0 over AF_UNIX, one object per line.

Methods (DESIGN.md): `ping`, `status`, `throttle`, `release`. The server runs in its own
threads, so the agent gets answers even while the engine is deep in a batch. Framing,
error codes and the 64 KiB request limit come from turbonode.jsonrpc; a malformed,
oversized or unknown request gets an error and the connection (and worker) carry on.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import socketserver
import stat
import threading
import time

import psutil
import torch

from turbonode import jsonrpc
from turbonode.errors import TurbonodeError
from turbonode.tiers import TIER_NAMES

from .throttle import PROTECTED_TIER

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
IDLE_TIMEOUT_S = 60.0      # a silent client does not hold a thread forever
MAX_CONNECTIONS = 32
GC_PAUSES_PER_STATUS = 256


class ControlHandlers:
    """The RPC methods, as plain callables taking keyword params (jsonrpc.dispatch calls them)."""

    def __init__(self, engine, gc_monitor, started: float | None = None, backend_info: dict | None = None):
        self.engine = engine
        self.gc = gc_monitor
        self.started = time.monotonic() if started is None else started
        self.backend_info = backend_info or engine.backend.describe()
        self._gc_cursor = 0
        self._lock = threading.Lock()
        self._process = psutil.Process()

    def table(self) -> dict:
        return {"ping": self.ping, "status": self.status, "throttle": self.throttle, "release": self.release}

    def ping(self) -> dict:
        return {"pong": True, "pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started, 3)}

    def _gc(self, since_gc_seq) -> dict:
        if since_gc_seq is not None and (isinstance(since_gc_seq, bool) or not isinstance(since_gc_seq, int)):
            raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, "since_gc_seq must be an integer or null")
        with self._lock:
            cursor = self._gc_cursor if since_gc_seq is None else since_gc_seq
            pauses = self.gc.since(cursor, GC_PAUSES_PER_STATUS)
            if since_gc_seq is None:  # "since the previous call" needs a cursor to move
                self._gc_cursor = max(self._gc_cursor, pauses[-1]["seq"] if pauses else cursor)
        return {"last_seq": self.gc.last_seq, "pauses": pauses, "collections_total": self.gc.collections_total,
                "pause_seconds_total": round(self.gc.pause_seconds_total, 6)}

    def status(self, since_gc_seq=None) -> dict:
        out = self.engine.snapshot()
        throttle = self.engine.throttle.current()
        gpu = None
        if self.engine.backend.device.type == "cuda":
            gpu = torch.cuda.memory_allocated(self.engine.backend.device)
        out.update({
            "gc": self._gc(since_gc_seq),
            "memory": {"rss_bytes": self._process.memory_info().rss, "gpu_allocated_bytes": gpu},
            "throttle": throttle.describe(self.engine.throttle.now()) if throttle else None,
            "backend": self.backend_info,
            "text_cache": {"entries": len(self.engine.encoder), "hits": self.engine.encoder.hits,
                           "misses": self.engine.encoder.misses, "hit_ratio": self.engine.encoder.hit_ratio},
            "uptime_s": round(time.monotonic() - self.started, 3),
        })
        return out

    def throttle(self, max_batch=None, paused_tiers=(), step_caps=None, shed_tiers=(), reason=None, ttl_s=None) -> dict:
        try:
            t = self.engine.throttle.set(max_batch=max_batch, paused_tiers=paused_tiers, step_caps=step_caps,
                                         shed_tiers=shed_tiers, reason=reason if reason is not None else "",
                                         ttl_s=ttl_s)
        except ValueError as exc:
            raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, str(exc),
                                   {"protected_tier": PROTECTED_TIER, "tiers": list(TIER_NAMES)}) from None
        log.info("throttle set: %s", t.describe(self.engine.throttle.now()))
        self.engine.wake()
        return t.describe(self.engine.throttle.now())

    def release(self, reason="") -> dict:
        if not isinstance(reason, str):
            raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, "reason must be a string")
        old = self.engine.throttle.release()
        if old is not None:
            log.info("throttle released (%s)", reason or "no reason given")
        self.engine.wake()
        return {"released": old is not None, "reason": reason}


class _Handler(socketserver.StreamRequestHandler):
    timeout = IDLE_TIMEOUT_S

    def handle(self):
        server: ControlServer = self.server  # type: ignore[assignment]
        handlers = server.handlers.table()
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

    def _send(self, obj) -> bool:
        try:
            self.wfile.write(jsonrpc.encode(obj))
            self.wfile.flush()
        except OSError:
            return False
        return True


class ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, handlers: ControlHandlers, group: str | None = None):
        self.path = path
        self.handlers = handlers
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        prepare_socket_path(path)
        super().__init__(path, _Handler, bind_and_activate=False)
        try:
            self.server_bind()
            os.chmod(path, SOCKET_MODE)
            _chgrp(path, group)
            self.server_activate()
        except OSError:
            self.server_close()
            raise
        self._thread: threading.Thread | None = None

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(jsonrpc.encode(jsonrpc.error_response(
                    None, jsonrpc.INTERNAL_ERROR, f"too many control connections (max {MAX_CONNECTIONS})")))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def start(self) -> "ControlServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="turbonode-control", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(5)
        self.server_close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass


class SocketInUse(TurbonodeError):
    """Another live worker already serves the control socket."""


def prepare_socket_path(path: str) -> None:
    """Create the directory; remove a stale socket a dead worker left, but never a live one."""
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
            os.unlink(path)  # nobody listens: a stale socket from a worker that died
            return
    raise SocketInUse(f"another worker is already serving {path}")


def _chgrp(path: str, group: str | None) -> None:
    if not group:
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.info("group %r does not exist; %s stays owned by the worker's group", group, path)
        return
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        log.warning("cannot give %s to group %r (not root and not a member)", path, group)
