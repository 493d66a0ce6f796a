"""Helpers for the agent's tests: a small stand-in for the worker's control server (the agreed
JSON-RPC methods) on a real AF_UNIX socket, for tests that must not depend on a diffusion
model; one worker's unit of the agent (its feed, policy and throttle lane) for a socket; and a
scrape of one collector through a fresh registry."""

import os
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.levers import WorkerLevers
from agent.metrics import WatcherCollector
from agent.policy import DegradationPolicy, Rule
from agent.throttle_lane import ThrottleLane
from agent.watchers.worker import WorkerWatcher
from agent.watchers.worker_feed import WorkerFeed
from agent.worker_unit import WorkerUnit
from turbonode.config import LeversConfig, WorkerSpec
from turbonode.jsonrpc import INVALID_PARAMS, ControlClient, RpcError
from turbonode.rpc_server import UnixRpcServer


class MiniWorker:
    """Just enough of the worker's control contract: status with GC seq, events (long poll),
    throttle with TTL. `with_events=False` is a worker from before `events`."""

    def __init__(self, with_events: bool = True):
        self.pauses = []
        self.throttle_state = None
        self.calls = []
        self.throttled_at: list[float] = []  # wall clock of each throttle call, as it arrived
        self.turbo_wait = 0.0
        self.with_events = with_events
        self.changed = threading.Condition()

    def _last_seq(self) -> int:
        return self.pauses[-1]["seq"] if self.pauses else 0

    def _tiers(self) -> dict:
        return {"turbo": {"queued": 1, "in_flight": 0, "oldest_wait_s": self.turbo_wait, "queue_wait_p99_s": 0.0}}

    def status(self, since_gc_seq=None):
        t = self.throttle_state
        if t and time.monotonic() > t["expires"]:
            self.throttle_state = t = None
        pauses = [p for p in self.pauses if since_gc_seq is None or p["seq"] > since_gc_seq]
        return {
            "tiers": self._tiers(),
            "step_time_s": {"last": 0.04, "p50": 0.04, "p99": 0.05},
            "max_batch": 4,
            "gc": {"last_seq": self._last_seq(), "pauses": pauses},
            "throttle": t and {k: v for k, v in t.items() if k != "expires"},
            "backend": {"name": "mini", "device": "cpu"},
            "uptime_s": 1.0,
        }

    def events(self, since_gc_seq=None, gc_pause_s=None, turbo_wait_s=None, timeout_s=1.0):
        cursor = self._last_seq() if since_gc_seq is None else since_gc_seq
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                new = [p for p in self.pauses if p["seq"] > cursor]
                if gc_pause_s is not None and any(p["pause_s"] > gc_pause_s for p in new):
                    event = "gc_pause"
                elif turbo_wait_s is not None and self.turbo_wait > turbo_wait_s:
                    event = "turbo_wait"
                elif cursor <= self._last_seq() and self.changed.wait(max(0.0, deadline - time.monotonic())):
                    continue
                else:
                    event = None
                return {"event": event, "gc": {"last_seq": self._last_seq(), "pauses": new}, "tiers": self._tiers()}

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
        lock_memory=False,
    ):
        if "turbo" in list(paused_tiers) + list(shed_tiers) + list(step_caps or {}):
            raise RpcError(INVALID_PARAMS, "turbo is never throttled")
        self.calls.append(("throttle", reason))
        self.throttled_at.append(time.time())
        self.throttle_state = {
            "max_batch": max_batch,
            "paused_tiers": list(paused_tiers),
            "intra_op_threads": intra_op_threads,
            "lock_memory": lock_memory,
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
        with self.changed:
            self.pauses.append({"seq": len(self.pauses) + 1, "generation": 2, "pause_s": pause_s, "at": time.time()})
            self.changed.notify_all()

    def set_turbo_wait(self, seconds):
        with self.changed:
            self.turbo_wait = seconds
            self.changed.notify_all()

    def serve(self, path: str) -> UnixRpcServer:
        self.client = ControlClient(path, timeout=1.0)
        methods = {"status": self.status, "throttle": self.throttle, "release": self.release, "ping": self.ping}
        if self.with_events:
            methods["events"] = self.events
        return UnixRpcServer(path, methods).start()


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


def agent_unit(
    path: str, rules: tuple[Rule, ...] = (), ttl_s: float = 3.0, name: str = "default", timeout: float = 0.5
) -> WorkerUnit:
    """The agent's unit for the worker at `path` (as agent/worker_unit.worker_unit builds it, with
    the rules given), its throttle lane started; `loop.shutdown` or `unit.lane.close` ends it."""
    spec = WorkerSpec(name, path, "", (), "cpu", "", frozenset())
    feed = WorkerWatcher(WorkerFeed(path, {r.signal: r.enter for r in rules}, name=name))
    lane = ThrottleLane(name, ControlClient(path, timeout=timeout), ttl_s).start()
    return WorkerUnit(spec, feed, None, DegradationPolicy(rules), lane, WorkerLevers(LeversConfig(), name))
