"""An operator's hold on the worker (issue 10, section 3): `turboctl throttle --hold` is not
replaced or released by the agent's decisions until `turboctl release` or its expiry, and both
`turboctl status` and `turboctl worker status` show it. The real worker control server (tiny
model engine), a real agent process that wants to throttle at every sample, the real CLI."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from bench.node import wait_for
from render.front.control_server import ControlHandlers, ControlServer
from render.gc_telemetry import GcMonitor
from tests.helpers import daemon_env, start, stop, turboctl_argv
from tests.render.helpers import make_engine
from turboctl import main
from turbonode.jsonrpc import ControlClient

# Every sample escalates: cpu_load >= 0 is always above an enter threshold of 0.
ESCALATE = "[policy]\nenter_s = 0\nmin_change_interval = 0.1\n[policy.rules.cpu_load]\nenter = 0.0\nexit = 0.0\n"


@pytest.fixture
def worker(tmp_path):
    engine = make_engine()
    monitor = GcMonitor().install()
    path = str(tmp_path / "worker.sock")
    server = ControlServer(path, ControlHandlers(engine, monitor)).start()
    yield engine, path
    server.close()
    monitor.uninstall()


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output
    return result


@pytest.mark.slow
def test_the_agent_respects_an_operator_hold_until_it_is_released(tmp_path, worker):
    engine, wsock = worker
    res = cli("throttle", "--socket", wsock, "--hold", "--max-batch", "1", "--reason", "maintenance")
    assert res.exit_code == 0 and "held (maintenance); expires in 3600" in res.output, res.output
    # Without --hold the operator's own throttle cannot replace the hold by mistake either.
    res = cli("throttle", "--socket", wsock, "--max-batch", "3", "--reason", "oops")
    assert res.exit_code == 1 and "an operator hold is in force (maintenance" in res.output, res.output

    sock = f"{tmp_path}/agent.sock"
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nsocket = "{sock}"\nworker_socket = "{wsock}"\nmetrics = "127.0.0.1:0"\n'
        f"sample_period = 0.1\nthrottle_ttl = 0.6\n{ESCALATE}"
    )
    proc, out = start(turboctl_argv("-v", "agent", "run", "--config", str(cfg)), daemon_env())
    try:
        agent = ControlClient(sock, timeout=2.0, peer="agent")
        status = lambda: _status(agent)
        seen = lambda: status().get("workers", {}).get("default", {})
        assert wait_for(lambda: seen().get("hold"), 30), out.text
        st = seen()
        assert st["level"] != "normal" and st["applied"]  # it wants to throttle
        assert st["hold"]["reason"] == "maintenance" and st["throttle_error"] is None
        # Several renew intervals later the worker still holds the operator's throttle.
        assert not wait_for(lambda: engine.throttle.current().reason != "maintenance", 2)
        assert engine.throttle.current().hold and engine.limits().max_batch == 1
        text = wait_for(lambda: "(operator hold)" in (r := cli("status", "--socket", sock)).output and r.output, 3)
        assert text and "hold:     the operator holds the worker (maintenance)" in text, text
        res = cli("worker", "status", "--socket", wsock)
        assert "throttle: maintenance" in res.output and "operator hold" in res.output, res.output
        assert out.text.count("worker default held by the operator (maintenance)") == 1  # once, not every sample

        res = cli("release", "--socket", wsock, "--reason", "done")
        assert res.exit_code == 0 and "released the operator hold" in res.output, res.output
        # The agent takes over again within a renew interval: its own throttle, no hold.
        assert wait_for(lambda: (t := engine.throttle.current()) and "cpu_load" in t.reason, 3), out.text
        assert not engine.throttle.current().hold
        assert wait_for(lambda: seen()["hold"] is None, 3)
    finally:
        rc = stop(proc, 30)
    assert rc == 0, out.text
    assert "worker default: the operator's hold is over" in out.text


def _status(agent: ControlClient) -> dict:
    try:
        return agent.call("status")
    except Exception:  # not up yet
        return {}
