"""The worker's control socket: JSON-RPC 2.0 over AF_UNIX, one object per line.

Methods (docs/design.md, control protocol): `ping`, `status`, `events`, `throttle`, `release`. The server runs
in its own threads (turbonode.rpc_server), so the agent gets answers even while the engine is
deep in a batch, and may hold an `events` call open until something happens (a long poll):
that is how GC pauses and turbo queue-wait excursions reach the agent at once instead of at
its next poll. A malformed, oversized or unknown request gets an error and the worker carries on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import psutil

from render.throttle import Held
from turbonode import jsonrpc
from turbonode.config import DEFAULT_WORKER
from turbonode.rpc_server import UnixRpcServer
from turbonode.throttle_params import THROTTLE_HELD
from turbonode.tiers import PROTECTED_TIER, TIER_NAMES

from .readiness import Readiness

log = logging.getLogger(__name__)

GC_PAUSES_PER_STATUS = 256
MAX_EVENTS_WAIT_S = 10.0  # the longest an `events` call may wait: a client that vanished frees its thread


def _optional_seconds(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, f"{name} must be a number of seconds >= 0 or null")
    return float(value)


class ControlHandlers:
    """The RPC methods, as plain callables taking keyword params (jsonrpc.dispatch calls them)."""

    def __init__(
        self,
        engine,
        gc_monitor,
        started: float | None = None,
        backend_info: dict | None = None,
        readiness: Callable[[str | None], Readiness] | None = None,
        name: str = DEFAULT_WORKER,
    ):
        self.engine, self.name = engine, name  # name: the node's name for this worker ([workers.<name>])
        self.readiness = readiness  # the HTTP API's (render/front/http_api.py): what /readyz?tier=T answers
        self.gc = gc_monitor
        self.started = time.monotonic() if started is None else started
        self.backend_info = backend_info or engine.backend.describe()
        self._gc_cursor = 0
        self._lock = threading.Lock()
        # the worker's processes: this one and, where the engine runs apart, the engine's
        self._processes = [psutil.Process(pid) for pid in dict.fromkeys((os.getpid(), engine.pid))]

    def table(self) -> dict:
        return {
            "ping": self.ping,
            "status": self.status,
            "events": self.events,
            "throttle": self.throttle,
            "release": self.release,
        }

    def ping(self) -> dict:
        return {
            "pong": True,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "name": self.name,
        }

    @staticmethod
    def _check_cursor(since_gc_seq) -> None:
        if since_gc_seq is not None and (isinstance(since_gc_seq, bool) or not isinstance(since_gc_seq, int)):
            raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, "since_gc_seq must be an integer or null")

    def _gc(self, since_gc_seq) -> dict:
        self._check_cursor(since_gc_seq)
        with self._lock:
            cursor = self._gc_cursor if since_gc_seq is None else since_gc_seq
            pauses = self.gc.since(cursor, GC_PAUSES_PER_STATUS)
            if since_gc_seq is None:  # "since the previous call" needs a cursor to move
                self._gc_cursor = max(self._gc_cursor, pauses[-1]["seq"] if pauses else cursor)
        return {
            "last_seq": self.gc.last_seq,
            "pauses": pauses,
            "collections_total": self.gc.collections_total,
            "pause_seconds_total": round(self.gc.pause_seconds_total, 6),
        }

    def status(self, since_gc_seq=None) -> dict:
        out = self.engine.snapshot()
        throttle = self.engine.throttle.current()
        gpu = out.pop("gpu_allocated_bytes")  # status shows it under memory
        out.pop("backlog")  # every image in the queue, for admission's replay: not for the agent's polls
        out.update(
            {
                "gc": self._gc(since_gc_seq),
                "memory": {"rss_bytes": self._rss(), "gpu_allocated_bytes": gpu, "lock": self._locks(out)},
                "throttle": throttle.describe(self.engine.throttle.now()) if throttle else None,
                "model": self.engine.describe_model(),
                "backend": self.backend_info,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "name": self.name,
                # whose CPU time is the worker's own, not load on the node (agent/watchers/cpu.py)
                "pids": [process.pid for process in self._processes],
            }
        )
        if self.readiness is not None:
            out["ready"] = {
                tier: {"ready": r.ready, "status": r.status, "reason": r.reason}
                for tier in TIER_NAMES
                for r in [self.readiness(tier)]
            }
        return out

    def _locks(self, snapshot: dict) -> dict:
        """Each process's memory lock (render/memory_lock.py): the engine's from its snapshot."""
        out = {"engine": snapshot.pop("memory_lock", None)}
        front = getattr(self.engine, "front_memory_lock", None)  # when the engine is another process
        if front is not None:
            out["front"] = front.status()
        return out

    def _rss(self) -> int:
        total = 0
        for process in self._processes:
            with contextlib.suppress(psutil.Error):  # the engine process may just have exited
                total += process.memory_info().rss
        return total

    def events(self, since_gc_seq=None, gc_pause_s=None, turbo_wait_s=None, timeout_s=1.0) -> dict:
        """Wait until a GC pause longer than `gc_pause_s` follows `since_gc_seq` (null: now), or the
        oldest queued turbo job has waited longer than `turbo_wait_s`, or `timeout_s` passed; a null
        threshold never wakes. A cursor ahead of this process's pauses (the caller knew an earlier
        worker) answers at once. The answer names the event (null: none) and carries the GC pauses
        since the cursor and the per-tier queues, as `status` does."""
        gc_over = _optional_seconds("gc_pause_s", gc_pause_s)
        turbo_over = _optional_seconds("turbo_wait_s", turbo_wait_s)
        wait_s = _optional_seconds("timeout_s", timeout_s)
        if wait_s is None or wait_s > MAX_EVENTS_WAIT_S:
            raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, f"timeout_s must be between 0 and {MAX_EVENTS_WAIT_S:g}")
        self._check_cursor(since_gc_seq)
        cursor = self.gc.last_seq if since_gc_seq is None else since_gc_seq
        deadline = time.monotonic() + wait_s
        event = None
        while cursor <= self.gc.last_seq:
            if gc_over is not None and self.gc.longest_since(cursor) > gc_over:
                event = "gc_pause"
                break
            turbo = self.engine.jobs.tiers(self.engine.clock())["turbo"]
            if turbo_over is not None and turbo["queued"] and turbo["oldest_wait_s"] > turbo_over:
                event = "turbo_wait"
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if turbo_over is not None and turbo["queued"]:  # wake when the oldest crosses the threshold
                left = min(left, turbo_over - turbo["oldest_wait_s"] + 0.001)
            if gc_over is None:
                time.sleep(left)
            else:
                self.gc.wait_for_pause(cursor, gc_over, left)
        return {
            "event": event,
            "gc": self._gc(cursor),
            "tiers": self.engine.jobs.tiers(self.engine.clock()),
        }

    def throttle(self, reason=None, ttl_s=None, hold=False, **limits) -> dict:
        """`limits`: turbonode.throttle_params.ThrottleLimits' fields (another name: invalid params)."""
        try:
            t = self.engine.throttle.set(reason=reason if reason is not None else "", ttl_s=ttl_s, hold=hold, **limits)
        except ValueError as exc:
            raise jsonrpc.RpcError(
                jsonrpc.INVALID_PARAMS, str(exc), {"protected_tier": PROTECTED_TIER, "tiers": list(TIER_NAMES)}
            ) from None
        except Held as exc:
            raise self._held(exc) from None
        self.engine.wake()
        return t.describe(self.engine.throttle.now())

    def release(self, reason="", hold=False) -> dict:
        if not isinstance(reason, str) or not isinstance(hold, bool):
            raise jsonrpc.RpcError(jsonrpc.INVALID_PARAMS, "reason must be a string and hold true or false")
        try:
            old = self.engine.throttle.release(hold)
        except Held as exc:
            raise self._held(exc) from None
        if old is not None:
            log.info("%s released (%s)", "operator hold" if old.hold else "throttle", reason or "no reason given")
        self.engine.wake()
        return {"released": old is not None, "reason": reason, "hold": old is not None and old.hold}

    def _held(self, exc: Held) -> jsonrpc.RpcError:
        hold = exc.hold.describe(self.engine.throttle.now())
        return jsonrpc.RpcError(
            THROTTLE_HELD,
            f"an operator hold is in force ({hold['reason']}, {hold['expires_in_s']:.0f} s left): "
            "`turboctl release` lifts it, `turboctl throttle --hold` replaces it",
            {"hold": hold},
        )


class ControlServer(UnixRpcServer):
    """The worker's control socket: ControlHandlers' methods (or, while the model loads, a table
    that says so: render/front/daemon.py) on the shared JSON-RPC transport."""

    def __init__(self, path: str, handlers: ControlHandlers | dict, group: str | None = None):
        table = handlers if isinstance(handlers, dict) else handlers.table()
        super().__init__(path, table, owner="worker", group=group)
