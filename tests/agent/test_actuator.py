"""A worker's throttle lane (agent/throttle_lane.py) against a small real AF_UNIX JSON-RPC server
(tests/helpers.py), driven turn by turn with a fake clock; and the node's relax-ceil action
against a recording datapath stand-in."""

import time

from agent.actuator import Actuator
from agent.policy import Actions
from agent.throttle_lane import ThrottleLane
from turbonode.jsonrpc import ControlClient


def test_absent_worker_is_a_state_not_a_crash(tmp_path):
    lane = ThrottleLane("w", ControlClient(str(tmp_path / "none.sock"), timeout=0.2), ttl_s=3.0, retry_s=0.1)
    lane.want({"max_batch": 1}, "pressured: x", "cpu_load")
    lane.step(0)
    assert "does not exist" in lane.error and lane.state()["sent"] is None
    assert lane.due_in(0.05) > 0 and lane.due_in(0.1) == 0  # tried again after retry_s, not at once


def test_throttle_renewed_then_released(worker):
    lane = ThrottleLane("w", worker.client, ttl_s=0.6)
    acts = {"max_batch": 2, "paused_tiers": ["relax"]}
    lane.want(acts, "pressured: cpu_load=0.9 > 0.75", "cpu_load")
    lane.step(0.0)
    assert worker.throttle_state["max_batch"] == 2 and worker.calls == [("throttle", "pressured: cpu_load=0.9 > 0.75")]
    lane.want(acts, "r", "cpu_load")
    lane.step(0.1)  # fresh: nothing sent
    assert len(worker.calls) == 1
    lane.step(0.25)  # a third of the TTL passed: renew
    assert len(worker.calls) == 2
    assert lane.counted() == {("throttle", "cpu_load"): 1, ("renew", "cpu_load"): 1}
    lane.want(None, "recovered", "cpu_load")
    lane.step(0.5)
    assert worker.calls[-1] == ("release", "recovered") and worker.throttle_state is None
    lane.step(0.75)
    assert len(worker.calls) == 3 and lane.due_in(0.75) is None  # released once, not every turn


def test_throttle_expires_when_agent_stops_renewing(worker):
    lane = ThrottleLane("w", worker.client, ttl_s=0.3)
    lane.want({"max_batch": 1}, "critical", "gc_pause_s")
    lane.step(0.0)
    assert worker.status()["throttle"]["max_batch"] == 1
    time.sleep(0.4)  # the agent "died": no renewal
    assert worker.status()["throttle"] is None


def test_the_lanes_thread_sends_at_once_and_releases_at_close(worker):
    lane = ThrottleLane("w", worker.client, ttl_s=3.0).start()
    lane.want({"max_batch": 1}, "critical", "gc_pause_s")
    deadline = time.monotonic() + 2
    while worker.throttle_state is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert worker.throttle_state["max_batch"] == 1
    lane.want(None, "agent stopping", "shutdown")
    lane.close(time.monotonic() + 2)
    assert worker.calls[-1] == ("release", "agent stopping") and worker.throttle_state is None


def test_dry_run_sends_nothing(worker, caplog):
    lane = ThrottleLane("w", worker.client, ttl_s=3.0, dry_run=True)
    with caplog.at_level("INFO", logger="turbonode.agent"):
        lane.want({"max_batch": 2}, "degraded: cpu_load=0.9 > 0.75", "cpu_load")
        lane.step(0)
    assert worker.calls == []
    assert "dry-run: would throttle worker w" in caplog.text and "max_batch" in caplog.text
    assert lane.counted()[("throttle", "cpu_load")] == 1


class RecordingDatapath:
    def __init__(self):
        self.calls = []

    def limit(self, tier, ceil_bps, lease_s):
        self.calls.append(("limit", tier, ceil_bps, lease_s))
        return {}

    def renew(self, tier, lease_s):
        self.calls.append(("renew", tier, lease_s))
        return 0.0

    def lift(self, tier):
        self.calls.append(("lift", tier))


def test_relax_ceil_is_a_lease_renewed_like_the_throttle_then_lifted():
    dp = RecordingDatapath()
    act = Actuator(ttl_s=3.0, datapath=dp, relax_rate_bps=10_000_000, link_bps=100_000_000)
    act.apply(Actions(), "n", "cpu_load", 0)  # nothing lowered, nothing to lift
    act.apply(Actions(50), "p", "cpu_load", 0)
    act.apply(Actions(50), "p", "cpu_load", 0.5)  # fresh: nothing
    act.apply(Actions(50), "p", "cpu_load", 1.0)  # a third of the lease: renewed
    act.apply(Actions(5), "c", "cpu_load", 1.2)  # never below the guaranteed rate
    act.apply(Actions(), "n", "cpu_load", 1.3)
    act.apply(Actions(), "n", "cpu_load", 5.0)  # lifted once, not every sample
    assert dp.calls == [
        ("limit", "relax", 50_000_000, 3.0),
        ("renew", "relax", 3.0),
        ("limit", "relax", 10_000_000, 3.0),
        ("lift", "relax"),
    ]
    assert act.counts == {("relax_ceil", "cpu_load"): 3}
    assert act.state()["relax_ceil_bps"] is None
