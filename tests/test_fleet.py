"""The sandbox fleet (sandbox/fleet.py) small: two nodes behind the shipped HAProxy configuration.
A node not ready for turbo gets no new turbo while the other is ready, a request it refuses is
redispatched, and the requests in flight on a worker killed with -9 end in a retry or a clear
error, never a hang, while the supervisor brings the worker back. The configuration transforms
(fleet_config, plain_config) run without a fleet (tests/test_operator_balancer.py checks
`haproxy -c` on the file as shipped)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import KERNEL_SKIP
from daemon_harness import ROOT

from sandbox.fleet import SHIPPED_CONFIG, FleetSettings, SandboxFleet, fleet_config, plain_config
from sandbox.settings import DemoSettings

needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (scripts/setup.sh)")

# In the client namespace: n turbo requests through HAProxy at once when a line arrives on stdin.
BURST = r"""
import json, sys, threading
from dataclasses import asdict
from sandbox.loadgen import request_image
url, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.stdin.readline()
outs = []
def one():
    outs.append(request_image(url, "turbo", 64, steps, timeout=60))
threads = [threading.Thread(target=one) for _ in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps([asdict(o) for o in outs]))
"""


class Burst:
    """Requests started at once on `go`, their outcomes on `results`."""

    def __init__(self, fleet: SandboxFleet, n: int, steps: int = 2):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-c", BURST, fleet.url, str(n), str(steps)]
        self.proc = subprocess.Popen(
            fleet.net.cmd(fleet.net.client, *argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        time.sleep(1.0)  # python started and waiting

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def results(self, timeout: float = 120) -> list[dict]:
        out, _ = self.proc.communicate(timeout=timeout)
        return json.loads(out)


def turbo_503s(fleet: SandboxFleet, i: int) -> float:
    """Turbo requests node i answered 503, from its /metrics (read from the front namespace)."""
    url = f"http://{fleet.nodes[i].address}/metrics"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    text = fleet.net.run(fleet.net.balancer, sys.executable, "-c", code).stdout
    total = 0.0
    for line in text.splitlines():
        if line.startswith("turbonode_worker_requests_total{") and 'tier="turbo"' in line and 'code="503"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_fleet_config_substitutes_addresses_only():
    text = SHIPPED_CONFIG.read_text()
    servers = [("a", "10.254.20.2:8460"), ("b", "10.254.21.2:8460"), ("c", "10.254.22.2:8460")]
    out = fleet_config(text, servers, "/tmp/x/haproxy.sock")
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("server ")]
    shipped = [line.strip() for line in text.splitlines() if line.strip().startswith("server ")]
    options = shipped[0].split(" id ")[1].split(" ", 1)[1]
    backends = sum(1 for line in text.splitlines() if line.startswith("backend "))
    assert lines == [f"server {n} {a} id {i} {options}" for i, (n, a) in enumerate(servers, 1)] * backends
    # every other line as shipped (the stats socket's path aside)
    rest = [line for line in out.splitlines() if not line.strip().startswith("server ")]
    want = [line for line in text.splitlines() if not line.strip().startswith("server ")]
    assert rest == [line.replace("/run/haproxy/turbonode.sock", "/tmp/x/haproxy.sock") for line in want]
    plain = "\n".join(line for line in plain_config(out).splitlines() if not line.lstrip().startswith("#"))
    assert "httpchk" not in plain and "retry-on" not in plain and "balance leastconn" not in plain
    assert plain.count("balance roundrobin") == backends and plain.count(" check") == len(lines)
    with pytest.raises(ValueError, match="template"):
        fleet_config("global\n    stats socket /run/haproxy/turbonode.sock\n", servers, "/tmp/s")


@pytest.mark.slow
@needs_haproxy
@pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
def test_two_nodes_behind_haproxy_unready_refused_and_killed():
    settings = FleetSettings(
        nodes=2, cpus=0.8, node=DemoSettings(size=64, worker_config={"refuse_unready": True}, keep_logs=False)
    )
    with SandboxFleet(settings, log=print) as fleet:
        node0, node1 = fleet.nodes
        balancer = fleet.balancer
        assert balancer is not None

        # healthy: turbo spread over both
        burst = Burst(fleet, 6)
        burst.go()
        healthy = burst.results()
        assert {o["status"] for o in healthy} == {200} and {o["server"] for o in healthy} == {"node0", "node1"}

        # node0 not ready for turbo (as its agent says at level critical): a burst sent at once meets
        # node0 before HAProxy's checks take it out; node0 refuses with 503, HAProxy redispatches
        burst = Burst(fleet, 6)
        refused_before = turbo_503s(fleet, 0)
        node0.worker_rpc.call("throttle", unready_tiers=["turbo"], reason="test: level critical", ttl_s=120)
        burst.go()
        answers = burst.results()
        assert [o["status"] for o in answers] == [200] * 6 and {o["server"] for o in answers} == {"node1"}, answers
        assert turbo_503s(fleet, 0) > refused_before, "no request met node0 before its check: nothing was redispatched"
        assert any(r["backend"] == "turbo" and r["retries"].startswith("+") for r in balancer.retried())
        states = balancer.wait({("turbo", "node0"): "DOWN"}, 10)
        assert states[("turbo", "node0")].startswith("DOWN") and states[("workers", "node0")] == "UP", states
        burst = Burst(fleet, 4)  # checked down: no new turbo reaches node0
        burst.go()
        assert {o["server"] for o in burst.results()} == {"node1"}
        node0.worker_rpc.call("release")
        assert balancer.wait({("turbo", "node0"): "UP"}, 10)[("turbo", "node0")] == "UP"

        # kill -9 while turbo requests run on node0: each ends retried elsewhere or with a clear error
        retried_before = len(balancer.retried())
        burst = Burst(fleet, 6, steps=60)
        burst.go()
        deadline = time.monotonic() + 30
        while node0.worker_rpc.call("status")["tiers"]["turbo"]["in_flight"] == 0:
            assert time.monotonic() < deadline, "no turbo job ever ran on node0"
            time.sleep(0.02)
        exits = len(node0.worker_exits)
        killed = node0.kill_worker()
        t0 = time.monotonic()
        answers = burst.results(timeout=150)
        assert time.monotonic() - t0 < 120  # nothing hung
        assert len(answers) == 6
        for o in answers:
            assert o["status"] == 200 or (o["status"] >= 500 and o["error"]), o
        assert len(balancer.retried()) > retried_before, "the requests in flight on node0 were not retried"
        assert {o["server"] for o in answers if o["status"] == 200} <= {"node0", "node1"}
        # the node's supervisor starts the worker again; HAProxy takes it back
        back = node0.wait_back(exits + 1, 240)
        assert back is not None, "the worker did not come back"
        assert node0.worker_exits[-1][0] >= killed
        up = balancer.wait({("turbo", "node0"): "UP", ("workers", "node0"): "UP"}, 20)
        assert up[("turbo", "node0")] == "UP", up
        print(f"node0's worker back {back - killed:.1f} s after the kill")
    # everything it made is gone
    assert fleet.net.balancer not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not fleet.work.exists()
