"""The agent daemon as a subprocess (`turboctl agent run`): CPU load escalates it, the throttle
arrives at a worker control socket (tests/helpers.MiniWorker) and is released after
recovery; status socket, metrics endpoint, dry-run, absent worker and `turboctl status`
against the running agent."""

import json
import os
import time
import urllib.request

import pytest
from click.testing import CliRunner

from bench.node import wait_for
from tests.agent.helpers import start_agent, stop_agent
from tests.helpers import FakeProc
from turboctl import main


@pytest.mark.slow
def test_cpu_load_throttles_worker_then_recovers(tmp_path, worker):
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    fake = FakeProc(proc_root)
    proc, agent, port = start_agent(
        tmp_path,
        tmp_path / "worker.sock",
        f'procfs = "{proc_root}"\n[policy]\nexit_s = 1.0\nmin_change_interval = 0.5\n'
        'disabled = ["netrx_cpu_share", "netrx_latency_p99_s"]\n[node]\nname = "tn-agent-test"\n',
    )
    try:
        assert wait_for(lambda: agent.call("status")["level"] == "normal", 10)
        scrape = lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        # the worker's first answer reaches the loop with a sample after the first;
        # every series carries the configured node name (node.name)
        # and a worker's series its `worker` label
        worker_ok = 'turbonode_worker_collector_success{node="tn-agent-test",worker="default"} 1.0'
        text = wait_for(lambda: (t := scrape()) and worker_ok in t and t, 5)
        assert text, scrape()
        assert 'turbonode_cpu_collector_success{node="tn-agent-test"} 1.0' in text
        assert 'turbonode_degradation_level{node="tn-agent-test",worker="default"} 0.0' in text
        fake.busy = 0.9
        assert wait_for(lambda: worker.throttle_state, 5), "no throttle within 5 s of 90 % CPU"
        assert "cpu_load=0.9 > 0.35" in worker.throttle_state["reason"]
        st = wait_for(lambda: (s := agent.call("status"))["last_change"] and s, 2)
        assert st["level"] != "normal" and st["last_change"]["reasons"][0]["signal"] == "cpu_load"
        # The worker's own view of its throttle arrives with the agent's next sample.
        status = ["status", "--socket", f"{tmp_path}/agent.sock", "--worker-socket", f"{tmp_path}/worker.sock"]
        cli = lambda: CliRunner().invoke(main, status)
        result = wait_for(lambda: (r := cli()).exit_code == 0 and "throttle: max_batch=" in r.output and r, 2)
        assert result, cli().output
        assert "level:" in result.output and "cpu_load=0.9 > 0.35" in result.output
        assert "worker default: ok" in result.output
        js = CliRunner().invoke(main, [*status, "--json"])
        assert json.loads(js.output)["agent"]["workers"]["default"]["state"] == "ok"
        fake.busy = 0.72  # inside the hysteresis band: the level holds
        time.sleep(2)
        assert agent.call("status")["level"] != "normal"
        fake.busy = 0.2  # load gone: steps down one level per dwell, then releases
        assert wait_for(lambda: agent.call("status")["level"] == "normal", 20), agent.call("status")
        assert wait_for(lambda: worker.calls and worker.calls[-1][0] == "release", 2)
        assert worker.throttle_state is None
        actions = 'turbonode_throttle_actions_total{action="%s",node="tn-agent-test",reason="%s",worker="default"}'
        # the lane counts a release once the worker has answered it: just after the worker saw it
        released = actions % ("release", "recovery") + " 1.0"
        text = wait_for(lambda: (t := scrape()) and released in t and t, 2)
        assert text, scrape()
        assert actions % ("throttle", "cpu_load") in text
    finally:
        rc, out = stop_agent(proc)
        fake.close()
    assert rc == 0, out
    assert "escalate normal -> pressured: cpu_load=0.9 > 0.35" in out  # the decision, value and threshold
    assert "recover pressured -> normal" in out
    assert not os.path.exists(f"{tmp_path}/agent.sock")


def test_absent_worker_and_dry_run(tmp_path):
    proc, agent, _ = start_agent(
        tmp_path,
        tmp_path / "nobody.sock",
        "[policy]\nenter_s = 0\n[policy.rules.cpu_load]\nenter = 0.0\nexit = 0.0\n",
        ["--dry-run"],
    )
    try:
        st = wait_for(lambda: (s := agent.call("status"))["level"] != "normal" and s, 10)
        assert st, "a zero threshold must escalate"
        seen = lambda: agent.call("status")["workers"]["default"]
        st = wait_for(lambda: (w := seen())["state"] == "absent" and w["error"], 5)
        assert st and "does not exist" in st, seen()
        st = agent.call("status")
        assert st["actions"]["dry_run"] is True
        result = CliRunner().invoke(
            main, ["status", "--socket", f"{tmp_path}/agent.sock", "--worker-socket", f"{tmp_path}/nobody.sock"]
        )
        assert "worker default: unreachable" in result.output and "the agent sees it absent" in result.output
        assert "(dry-run)" in result.output and result.exit_code == 1
    finally:
        rc, out = stop_agent(proc)
    assert rc == 0, out
    assert "dry-run: would throttle worker" in out


def test_status_without_agent_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["status", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1
    assert "agent control socket" in result.output and "is the agent running" in result.output


def test_agent_run_names_bad_config_key(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[policy]\nexit_s = -1\n")
    result = CliRunner().invoke(main, ["agent", "run", "--config", str(cfg)])
    assert result.exit_code == 1 and "policy.exit_s" in result.output


def test_a_watcher_raising_anything_is_reported_and_the_agent_keeps_running(tmp_path):
    """A worker whose status lacks a key the watcher reads (KeyError) used to kill the agent."""
    from turbonode.rpc_server import UnixRpcServer

    good = {"gc": {"last_seq": 1, "pauses": []}, "tiers": {}}
    answer = {"status": good}
    wsock = str(tmp_path / "worker.sock")
    server = UnixRpcServer(wsock, {"status": lambda since_gc_seq=None: answer["status"]}).start()
    proc = None
    try:
        proc, agent, _ = start_agent(tmp_path, wsock, "sample_period = 0.1\n")
        seen = lambda: agent.call("status")["workers"]["default"]
        assert wait_for(lambda: seen()["watchers"]["worker"]["ok"], 10)
        answer["status"] = {"gc": {"last_seq": 5, "pauses": [{"seq": 5, "generation": 2}]}}  # no pause_s
        st = wait_for(lambda: (w := seen())["watchers"]["worker"]["error"] and w, 10)
        assert st and st["watchers"]["worker"]["error"] == "KeyError: 'pause_s'", st["watchers"]["worker"]
        assert (st["state"], st["error"]) == ("absent", "KeyError: 'pause_s'")
        time.sleep(0.5)  # several more samples of the same failure
        assert proc.poll() is None and agent.call("ping") == "pong"
        answer["status"] = good
        assert wait_for(lambda: seen()["watchers"]["worker"]["ok"], 10)
    finally:
        server.close()
        if proc is not None:
            rc, out = stop_agent(proc)
    assert rc == 0, out
    assert out.count("worker watcher failed: KeyError: 'pause_s'") == 1 and "Traceback" in out
