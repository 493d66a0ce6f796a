"""Helpers for the agent's tests: a small stand-in for the worker's control server (the agreed
JSON-RPC methods) on a real AF_UNIX socket, for tests that must not depend on a diffusion
model; and a scrape of one collector through a fresh registry."""

import os
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.metrics import WatcherCollector
from turbonode.jsonrpc import INVALID_PARAMS, ControlClient, RpcError
from turbonode.rpc_server import UnixRpcServer


class MiniWorker:
    """Just enough of the worker's control contract: status with GC seq, throttle with TTL."""

    def __init__(self):
        self.pauses = []
        self.throttle_state = None
        self.calls = []
        self.turbo_wait = 0.0

    def status(self, since_gc_seq=None):
        t = self.throttle_state
        if t and time.monotonic() > t["expires"]:
            self.throttle_state = t = None
        pauses = [p for p in self.pauses if since_gc_seq is None or p["seq"] > since_gc_seq]
        return {
            "tiers": {
                "turbo": {"queued": 0, "in_flight": 0, "oldest_wait_s": self.turbo_wait, "queue_wait_p99_s": 0.0}
            },
            "step_time_s": {"last": 0.04, "p50": 0.04, "p99": 0.05},
            "max_batch": 4,
            "gc": {"last_seq": self.pauses[-1]["seq"] if self.pauses else 0, "pauses": pauses},
            "throttle": t and {k: v for k, v in t.items() if k != "expires"},
            "backend": {"name": "mini", "device": "cpu"},
            "uptime_s": 1.0,
        }

    def throttle(
        self,
        reason,
        ttl_s,
        max_batch=None,
        paused_tiers=(),
        step_caps=None,
        shed_tiers=(),
        unready_tiers=(),
        intra_op_threads=None,
    ):
        if "turbo" in list(paused_tiers) + list(shed_tiers) + list(step_caps or {}):
            raise RpcError(INVALID_PARAMS, "turbo is never throttled")
        self.calls.append(("throttle", reason))
        self.throttle_state = {
            "max_batch": max_batch,
            "paused_tiers": list(paused_tiers),
            "intra_op_threads": intra_op_threads,
            "reason": reason,
            "expires": time.monotonic() + ttl_s,
        }
        return {"ok": True}

    def ping(self):
        return {"pong": True, "pid": os.getpid()}  # this test process: what `levers.worker_cgroup = "auto"` finds

    def release(self, reason=""):
        self.calls.append(("release", reason))
        self.throttle_state = None
        return {"ok": True}

    def gc(self, pause_s):
        self.pauses.append({"seq": len(self.pauses) + 1, "generation": 2, "pause_s": pause_s, "at": time.time()})

    def serve(self, path: str) -> UnixRpcServer:
        self.client = ControlClient(path, timeout=1.0)
        return UnixRpcServer(
            path, {"status": self.status, "throttle": self.throttle, "release": self.release, "ping": self.ping}
        ).start()


@pytest.fixture
def mini_worker(tmp_path):
    w = MiniWorker()
    srv = w.serve(str(tmp_path / "worker.sock"))
    yield w
    srv.close()


def scrape(watcher) -> str:
    """The text exposition of one watcher's collector, from a fresh registry."""
    reg = CollectorRegistry()
    reg.register(WatcherCollector(watcher))
    return generate_latest(reg).decode()
