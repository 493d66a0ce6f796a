"""Worker watcher and actuator against a small real AF_UNIX JSON-RPC server (the agreed
control methods), plus the relax-ceil action against a recording datapath stand-in."""

import time

import pytest

from agent.actuator import Actuator
from agent.policy import Actions
from agent.status_server import StatusServer
from agent.watchers.worker import WorkerWatcher
from turbonode.jsonrpc import INVALID_PARAMS, ControlClient, RpcError


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
        return {"tiers": {"turbo": {"queued": 0, "in_flight": 0, "oldest_wait_s": self.turbo_wait,
                                    "queue_wait_p99_s": 0.0}},
                "step_time_s": {"last": 0.04, "p50": 0.04, "p99": 0.05}, "max_batch": 4,
                "gc": {"last_seq": self.pauses[-1]["seq"] if self.pauses else 0, "pauses": pauses},
                "throttle": t and {k: v for k, v in t.items() if k != "expires"}}

    def throttle(self, reason, ttl_s, max_batch=None, paused_tiers=(), step_caps=None, shed_tiers=()):
        if "turbo" in list(paused_tiers) + list(shed_tiers) + list(step_caps or {}):
            raise RpcError(INVALID_PARAMS, "turbo is never throttled")
        self.calls.append(("throttle", reason))
        self.throttle_state = {"max_batch": max_batch, "paused_tiers": list(paused_tiers), "reason": reason,
                               "expires": time.monotonic() + ttl_s}
        return {"ok": True}

    def release(self, reason=""):
        self.calls.append(("release", reason))
        self.throttle_state = None
        return {"ok": True}

    def gc(self, pause_s):
        self.pauses.append({"seq": len(self.pauses) + 1, "generation": 2, "pause_s": pause_s, "at": time.time()})


@pytest.fixture
def worker(tmp_path):
    w = MiniWorker()
    path = str(tmp_path / "worker.sock")
    srv = StatusServer(path, {"status": w.status, "throttle": w.throttle, "release": w.release,
                              "ping": lambda: "pong"}).start()
    w.client = ControlClient(path, timeout=1.0)
    yield w
    srv.close()


def test_worker_watcher_reports_new_gc_pauses_only(worker):
    worker.gc(0.5)          # history before the agent looked: not news
    ww = WorkerWatcher(worker.client)
    assert ww.sample(0)["gc_pause_s"] is None and ww.ok
    worker.gc(0.007)
    worker.gc(0.009)
    worker.turbo_wait = 0.8
    sig = ww.sample(0.25)
    assert sig["gc_pause_s"] == 0.009 and sig["turbo_wait_s"] == 0.8
    assert ww.sample(0.5)["gc_pause_s"] is None   # nothing new since


def test_absent_worker_is_a_state_not_a_crash(tmp_path):
    ww = WorkerWatcher(ControlClient(str(tmp_path / "none.sock"), timeout=0.2))
    assert ww.sample(0) == {} and not ww.ok and "does not exist" in ww.error
    act = Actuator(ControlClient(str(tmp_path / "none.sock"), timeout=0.2))
    act.apply(Actions(None, {"max_batch": 1}), "pressured: x", "cpu_load", 0)
    assert "does not exist" in act.worker_error


def test_throttle_renewed_then_released(worker):
    act = Actuator(worker.client, ttl_s=0.6)
    acts = Actions(50, {"max_batch": 2, "paused_tiers": ["relax"]})
    act.apply(acts, "pressured: cpu_load=0.9 > 0.75", "cpu_load", 0.0)
    assert worker.throttle_state["max_batch"] == 2 and worker.calls == [("throttle", "pressured: cpu_load=0.9 > 0.75")]
    act.apply(acts, "r", "cpu_load", 0.1)          # fresh: nothing sent
    assert len(worker.calls) == 1
    act.apply(acts, "r", "cpu_load", 0.25)         # a third of the TTL passed: renew
    assert len(worker.calls) == 2
    assert act.counts == {("throttle", "cpu_load"): 1, ("renew", "cpu_load"): 1}
    act.apply(Actions(), "recovered", "cpu_load", 0.5)
    assert worker.calls[-1] == ("release", "recovered") and worker.throttle_state is None
    act.apply(Actions(), "recovered", "cpu_load", 0.75)
    assert len(worker.calls) == 3                   # released once, not every sample


def test_throttle_expires_when_agent_stops_renewing(worker):
    act = Actuator(worker.client, ttl_s=0.3)
    act.apply(Actions(None, {"max_batch": 1}), "critical", "gc_pause_s", 0.0)
    assert worker.status()["throttle"]["max_batch"] == 1
    time.sleep(0.4)   # the agent "died": no renewal
    assert worker.status()["throttle"] is None


def test_dry_run_sends_nothing(worker, caplog):
    act = Actuator(worker.client, dry_run=True)
    with caplog.at_level("INFO", logger="turbonode.agent"):
        act.apply(Actions(25, {"max_batch": 2}), "degraded: cpu_load=0.9 > 0.75", "cpu_load", 0)
    assert worker.calls == []
    assert "dry-run: would throttle worker" in caplog.text and "max_batch" in caplog.text
    assert act.counts[("throttle", "cpu_load")] == 1


class RecordingDatapath:
    def __init__(self):
        self.calls = []

    def set_rate(self, tier, rate_bps, ceil_bps):
        self.calls.append((tier, rate_bps, ceil_bps))


def test_relax_ceil_lowered_and_restored():
    dp = RecordingDatapath()
    act = Actuator(None, datapath=dp, relax_rate_bps=10_000_000, relax_ceil_bps=100_000_000, link_bps=100_000_000)
    act.apply(Actions(50), "p", "cpu_load", 0)
    act.apply(Actions(50), "p", "cpu_load", 1)
    act.apply(Actions(5), "c", "cpu_load", 2)       # never below the guaranteed rate
    act.apply(Actions(), "n", "cpu_load", 3)
    assert dp.calls == [("relax", 10_000_000, 50_000_000), ("relax", 10_000_000, 10_000_000),
                        ("relax", 10_000_000, 100_000_000)]
