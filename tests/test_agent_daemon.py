"""The agent daemon as a subprocess (`turboctl agent run`): real /proc, real BPF, a real CPU
fault from stress-ng, the throttle arriving at a worker control socket and its release after
recovery; status socket, metrics endpoint and `turboctl status` against the running agent."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent.cli import main
from tests.mini_worker import MiniWorker
from turbonode.jsonrpc import ControlClient

ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


def start_agent(tmp_path, worker_sock, extra="", args=()):
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[agent]\nsocket = "{tmp_path}/agent.sock"\nworker_socket = "{worker_sock}"\n'
                   f'metrics = "127.0.0.1:{port}"\nthrottle_ttl = 1.0\n{extra}')
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "run", "--config", str(cfg), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agent = ControlClient(f"{tmp_path}/agent.sock", timeout=1.0, peer="agent")

    def ready():
        try:
            return agent.call("status").get("level")
        except Exception:
            return None
    if not wait_for(ready, 20):
        proc.kill()
        pytest.fail(f"agent did not come up:\n{proc.communicate()[0]}")
    return proc, agent, port


def stop(proc) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    return proc.returncode, out


@pytest.fixture
def worker(tmp_path):
    w = MiniWorker()
    srv = w.serve(str(tmp_path / "worker.sock"))
    yield w
    srv.close()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("stress-ng") is None, reason="stress-ng not installed (scripts/setup.sh)")
def test_cpu_fault_throttles_worker_then_recovers(tmp_path, worker):
    proc, agent, port = start_agent(tmp_path, tmp_path / "worker.sock",
                                    "[policy]\nexit_samples = 4\nmin_change_interval = 0.5\n")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "turbonode_cpu_collector_success 1.0" in text
        assert "turbonode_worker_collector_success 1.0" in text
        assert "turbonode_degradation_level" in text
        # Real fault: every CPU busy for a bounded 3 s.
        stress = subprocess.Popen(["stress-ng", "--cpu", str(os.cpu_count()), "--timeout", "3s", "--quiet"])
        try:
            assert wait_for(lambda: worker.throttle_state, 5), "no throttle within 5 s of CPU saturation"
            assert "cpu_load" in worker.throttle_state["reason"]
            st = agent.call("status")
            assert st["level"] != "normal" and st["last_change"]["reasons"][0]["signal"] == "cpu_load"
            result = CliRunner().invoke(main, ["status", "--socket", f"{tmp_path}/agent.sock"])
            assert result.exit_code == 0, result.output
            assert "level:" in result.output and "cpu_load=" in result.output and "worker:   ok" in result.output
            js = CliRunner().invoke(main, ["status", "--json", "--socket", f"{tmp_path}/agent.sock"])
            assert json.loads(js.output)["worker"]["state"] == "ok"
        finally:
            stress.wait(timeout=10)
        # After the load ends the agent steps down and releases the worker.
        assert wait_for(lambda: agent.call("status")["level"] == "normal", 20), agent.call("status")
        assert wait_for(lambda: worker.calls and worker.calls[-1][0] == "release", 2)
        assert worker.throttle_state is None
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'turbonode_throttle_actions_total{action="throttle",reason="cpu_load"}' in text
        assert 'turbonode_throttle_actions_total{action="release",reason="recovery"} 1.0' in text
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
    assert "escalate normal -> pressured: cpu_load=" in out   # the decision, its value and threshold
    assert not os.path.exists(f"{tmp_path}/agent.sock")


def test_absent_worker_and_dry_run(tmp_path):
    proc, agent, _ = start_agent(tmp_path, tmp_path / "nobody.sock", "[policy]\ncpu_load_enter = 0.0\n"
                                 "cpu_load_exit = 0.0\nenter_samples = 1\n", ["--dry-run"])
    try:
        st = wait_for(lambda: (s := agent.call("status"))["level"] != "normal" and s, 10)
        assert st, "a zero threshold must escalate"
        assert st["worker"]["state"] == "absent" and "does not exist" in st["worker"]["error"]
        assert st["actions"]["dry_run"] is True
        result = CliRunner().invoke(main, ["status", "--socket", f"{tmp_path}/agent.sock"])
        assert "worker:   absent" in result.output and "(dry-run)" in result.output
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
    assert "dry-run: would throttle worker" in out


def test_status_without_agent_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["status", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1
    assert "agent control socket" in result.output and "is the agent running" in result.output


def test_agent_run_names_bad_config_key(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[policy]\nexit_samples = 0\n")
    result = CliRunner().invoke(main, ["agent", "run", "--config", str(cfg)])
    assert result.exit_code == 1 and "policy.exit_samples" in result.output
