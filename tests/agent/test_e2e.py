"""End to end: the agent and the real worker (tiny model) around a sandbox node (bench/node.py).

The fault is real: cyclic garbage inside the worker process (bench/garbage.py) makes its
collector pause for tens of ms; the agent reads the pauses from the worker's status, throttles
that worker and leaves the node's relax ceil on the real HTB tree alone (a worker's own rule
acts on that worker only); after the garbage stops it steps back down and releases. Then the
agent is killed while throttling: the throttle expires on its own and the datapath stays in
place (fail-static). Only the GC rule is armed so that other load on a shared machine cannot
decide the outcome.
"""

import signal
import time

import pytest

from bench.node import Node, call, wait_for
from tests.helpers import needs_bcc

pytestmark = [needs_bcc, pytest.mark.root, pytest.mark.slow]

POLICY = (
    '[policy]\ndisabled = ["cpu_load", "netrx_cpu_share", "netrx_latency_p99_s"]\n'
    "exit_s = 1.0\nmin_change_interval = 0.5\n"
)


def test_gc_fault_throttles_real_worker_then_releases_and_expires(tmp_path):
    with Node(tmp_path, extra_toml=POLICY) as node:
        dp = node.datapath()
        status = lambda: call(node.agent_rpc, "status") or {}
        level = lambda: status().get("level")
        relax_ceil = lambda: dp.show()["tiers"]["relax"]["ceil_bps"]
        assert wait_for(lambda: level() == "normal", 10)
        assert relax_ceil() == 100_000_000

        node.worker.send_signal(signal.SIGUSR1)  # fault onset: garbage in the worker
        t = wait_for(node.throttle, 5)
        assert t, node.log("agent")[-2000:]
        assert "gc_pause_s" in t["reason"]
        # The agent publishes its status just after acting: wait for it rather than race it.
        change = wait_for(lambda: status().get("workers", {}).get("default", {}).get("last_change"), 2)
        assert change["reasons"][0]["signal"] == "gc_pause_s" and change["reasons"][0]["value"] > 0.005
        # GC pauses are the worker's own rule: it throttles that worker, and the node's relax
        # ceiling (which follows the node-wide rules) stays where it was
        assert status()["node"]["level"] == "normal" and relax_ceil() == 100_000_000

        node.worker.send_signal(signal.SIGUSR2)  # fault over
        assert wait_for(lambda: level() == "normal", 30), status()
        assert wait_for(lambda: node.throttle() is None, 2)
        assert wait_for(lambda: relax_ceil() == 100_000_000, 3)
        log = node.log("agent")
        assert "worker default: level escalate normal -> pressured: gc_pause_s=" in log
        assert "worker default: release" in log

        # The agent dies while throttling: nobody renews, the lease runs out, the datapath stays.
        node.worker.send_signal(signal.SIGUSR1)
        assert wait_for(node.throttle, 5)
        node.agent.kill()
        node.agent.wait(timeout=5)
        died = time.monotonic()
        node.worker.send_signal(signal.SIGUSR2)
        assert wait_for(lambda: node.throttle() is None, 3), node.throttle()
        assert time.monotonic() - died <= 2.5  # ttl 1 s, renewed every ttl/3 at most
        assert dp.show()["tiers"]["turbo"]["class"] == "1:10"
