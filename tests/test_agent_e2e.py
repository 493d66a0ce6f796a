"""End to end: the agent and the real worker (tiny model) around a sandbox node.

The fault is real: cyclic garbage inside the worker process (bench/garbage.py) makes its
collector pause for tens of ms; the agent reads the pauses from the worker's status, throttles
the worker and lowers the relax ceil on the real HTB tree; after the garbage stops it steps
back down and releases. Then the agent is killed while throttling: the throttle expires on
its own and the datapath stays in place (fail-static). Only the GC rule is armed so that other
load on a shared machine cannot decide the outcome.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import needs_bcc
from tests.test_agent_daemon import ROOT, free_port, wait_for
from turbonode.jsonrpc import ControlClient

pytestmark = [needs_bcc, pytest.mark.root, pytest.mark.slow]

WORKER_PY = ("import sys; sys.argv[0] = 'turboctl'; from bench.garbage import Garbage; Garbage().install(); "
             "from agent.cli import main; main()")


def quiet(client, method):
    try:
        return client.call(method)
    except Exception:
        return None


@pytest.fixture
def node(sandbox, tmp_path):
    wsock, asock = tmp_path / "worker.sock", tmp_path / "agent.sock"
    cfg = tmp_path / "turbonode.toml"
    cfg.write_text(
        f'[qos]\nrate = "100mbit"\n'
        f'[worker]\ncontrol_socket = "{wsock}"\nlisten = "127.0.0.1:{free_port()}"\n'
        f'[agent]\nsocket = "{asock}"\nworker_socket = "{wsock}"\nmetrics = "127.0.0.1:{free_port()}"\n'
        f'throttle_ttl = 1.0\n'
        '[policy]\ndisabled = ["cpu_load", "netrx_cpu_share", "netrx_latency_p99_s"]\n'
        'exit_samples = 4\nmin_change_interval = 0.5\n')
    env = {**os.environ, "PYTHONPATH": ROOT}
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("worker", "agent")}
    worker = subprocess.Popen([sys.executable, "-c", WORKER_PY, "worker", "run", "--config", str(cfg)],
                              env=env, stdout=logs["worker"], stderr=subprocess.STDOUT)
    procs = [worker]
    from tc.datapath import Datapath

    try:
        wrpc = ControlClient(str(wsock), timeout=1.0)
        assert wait_for(lambda: quiet(wrpc, "ping"), 90, 0.2), (tmp_path / "worker.log").read_text()
        agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "run", "--config", str(cfg),
                                  "--dev", sandbox.dev, "--netns", sandbox.server],
                                 env=env, stdout=logs["agent"], stderr=subprocess.STDOUT)
        procs.append(agent)
        arpc = ControlClient(str(asock), timeout=1.0, peer="agent")
        assert wait_for(lambda: quiet(arpc, "status"), 30, 0.2), (tmp_path / "agent.log").read_text()
        yield {"worker": worker, "agent": agent, "wrpc": wrpc, "arpc": arpc, "tmp": tmp_path,
               "datapath": Datapath(sandbox.dev, sandbox.server)}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        try:
            Datapath(sandbox.dev, sandbox.server).remove()
        except Exception:
            pass


def test_gc_fault_throttles_real_worker_then_releases_and_expires(node):
    wrpc, arpc, dp = node["wrpc"], node["arpc"], node["datapath"]
    throttle = lambda: (quiet(wrpc, "status") or {}).get("throttle")
    assert wait_for(lambda: quiet(arpc, "status")["level"] == "normal", 10)
    assert dp.show()["tiers"]["relax"]["ceil_bps"] == 100_000_000

    node["worker"].send_signal(signal.SIGUSR1)       # fault onset: garbage in the worker
    t = wait_for(throttle, 5)
    assert t, (node["tmp"] / "agent.log").read_text()[-2000:]
    assert "gc_pause_s" in t["reason"]
    st = quiet(arpc, "status")
    assert st["last_change"]["reasons"][0]["signal"] == "gc_pause_s"
    assert st["last_change"]["reasons"][0]["value"] > 0.005
    assert wait_for(lambda: dp.show()["tiers"]["relax"]["ceil_bps"] < 100_000_000, 3)

    node["worker"].send_signal(signal.SIGUSR2)       # fault over
    assert wait_for(lambda: quiet(arpc, "status")["level"] == "normal", 30), quiet(arpc, "status")
    assert wait_for(lambda: throttle() is None, 2)
    assert wait_for(lambda: dp.show()["tiers"]["relax"]["ceil_bps"] == 100_000_000, 3)
    log = (node["tmp"] / "agent.log").read_text()
    assert "escalate normal -> pressured: gc_pause_s=" in log and "worker release" in log

    # The agent dies while throttling: nobody renews, the lease runs out, the datapath stays.
    node["worker"].send_signal(signal.SIGUSR1)
    assert wait_for(throttle, 5)
    node["agent"].kill()
    node["agent"].wait(timeout=5)
    died = time.monotonic()
    node["worker"].send_signal(signal.SIGUSR2)
    assert wait_for(lambda: throttle() is None, 3), throttle()
    assert time.monotonic() - died <= 2.5           # ttl 1 s, renewed every ttl/3 at most
    shown = dp.show()
    assert shown["tiers"]["turbo"]["class"] == "1:10"
