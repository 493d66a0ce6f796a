"""The agent does only what it owns (issue 10, section 3): `--dry-run` changes nothing on the
node, and a second agent is refused before it touches anything: not the relax ceiling the
running agent lowered, not its worker's throttle, not its device. Real agent processes, a real
sandbox device, a worker stand-in on a real socket (tests/helpers.MiniWorker)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from bench.node import wait_for
from tests.helpers import daemon_env, needs_bcc, start, stop, turboctl_argv
from turbonode.jsonrpc import ControlClient

pytestmark = [needs_bcc, pytest.mark.root]

# Every sample escalates: cpu_load >= 0 is always above an enter threshold of 0.
ESCALATE = (
    "[policy]\nenter_s = 0\nmin_change_interval = 0.1\n"
    '[policy.rules.cpu_load]\nenter = 0.0\nexit = 0.0\nmax_level = "critical"\n'
)


def write_config(tmp_path, sandbox, name: str, *, socket: str, worker_socket: str, extra: str = "") -> str:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(
        f'[qos]\ndev = "{sandbox.dev}"\nnetns = "{sandbox.server}"\nrate = "100mbit"\n'
        f'[agent]\nsocket = "{socket}"\nworker_socket = "{worker_socket}"\nmetrics = "127.0.0.1:0"\n'
        f"sample_period = 0.1\nthrottle_ttl = 1.0\n{extra}"
    )
    return str(cfg)


def start_agent(config: str, *args: str):
    proc, out = start(turboctl_argv("-v", "agent", "run", "--config", config, *args), daemon_env())
    return proc, out


def tc(sandbox, *args: str) -> str:
    return sandbox.run(sandbox.server, "tc", *args, "dev", sandbox.dev).stdout


def relax_ceil(sandbox) -> str:
    """The ceiling of relax's limit class, where the agent lowers it (docs/qos.md, "Leased limits")."""
    line = next(x for x in tc(sandbox, "class", "show").splitlines() if x.startswith("class htb 1:41 "))
    return re.search(r"ceil (\S+)", line).group(1)


def test_dry_run_changes_nothing_on_the_node(sandbox, tmp_path):
    """No HTB tree, classifier, pins or lock files, during the run or after it; the log says
    what it would have done."""
    from tc.reconcile import places

    where = places(sandbox.dev, sandbox.server)
    before = (tc(sandbox, "qdisc", "show"), tc(sandbox, "class", "show"))
    sock = f"{tmp_path}/agent.sock"
    config = write_config(tmp_path, sandbox, "dry", socket=sock, worker_socket=f"{tmp_path}/none.sock", extra=ESCALATE)
    proc, out = start_agent(config, "--dry-run")
    try:
        agent = ControlClient(sock, timeout=2.0, peer="agent")
        st = wait_for(lambda: (s := _status(agent)) and s["level"] != "normal" and s, 30)
        assert st, out.text
        assert st["actions"]["dry_run"] is True
        assert (tc(sandbox, "qdisc", "show"), tc(sandbox, "class", "show")) == before
        assert not os.path.exists(where.pin_dir) and not os.path.exists(where.lock_file)
        assert out.wait_for(r"dry-run: would replace the root qdisc noqueue with htb 1:", 5), out.text
        assert out.wait_for(r"dry-run: would set relax ceil", 5), out.text
    finally:
        rc = stop(proc, 30)
    assert rc == 0, out.text
    assert (tc(sandbox, "qdisc", "show"), tc(sandbox, "class", "show")) == before
    assert not os.path.exists(where.pin_dir) and not os.path.exists(where.lock_file)


def _status(agent: ControlClient) -> dict | None:
    try:
        return agent.call("status")
    except Exception:
        return None


@pytest.mark.slow
def test_a_second_agent_touches_nothing_the_first_one_owns(sandbox, tmp_path, worker):
    """The first agent degrades the node (relax ceil lowered, worker throttled). A second one on
    the same socket, on another socket for the same worker, or on another socket and worker for
    the same device is refused naming the first, and has touched nothing."""
    worker_sock = f"{tmp_path}/worker.sock"
    sock = f"{tmp_path}/agent.sock"
    first = write_config(tmp_path, sandbox, "first", socket=sock, worker_socket=worker_sock, extra=ESCALATE)
    proc, out = start_agent(first)
    try:
        agent = ControlClient(sock, timeout=2.0, peer="agent")
        assert wait_for(lambda: (s := _status(agent)) and s["level"] == "critical", 30), out.text
        assert wait_for(lambda: relax_ceil(sandbox) == "10Mbit", 10), tc(sandbox, "class", "show")
        assert wait_for(lambda: worker.throttle_state, 5), out.text
        lowered = tc(sandbox, "class", "show")
        second_cases = [
            ("same-socket", sock, worker_sock, f"another agent (pid {proc.pid}) is already serving {sock}"),
            (
                "same-worker",
                f"{tmp_path}/agent2.sock",
                worker_sock,
                f"another agent (pid {proc.pid}) already throttles the worker at {worker_sock}",
            ),
            (
                "same-device",
                f"{tmp_path}/agent3.sock",
                f"{tmp_path}/other-worker.sock",
                f"{sandbox.dev} in netns {sandbox.server} is managed by a running turbonode agent (pid {proc.pid})",
            ),
        ]
        for name, socket, wsock, refusal in second_cases:
            calls = len(worker.calls)
            config = write_config(tmp_path, sandbox, name, socket=socket, worker_socket=wsock)
            res = subprocess.run(
                turboctl_argv("agent", "run", "--config", config),
                env=daemon_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert res.returncode == 1, (name, res.stdout + res.stderr)
            # Nothing the first agent set was touched: its worker got no release, the ceil stays.
            assert [c for c in worker.calls[calls:] if c[0] == "release"] == [], (name, worker.calls)
            assert tc(sandbox, "class", "show") == lowered, (name, res.stderr)
            assert refusal in res.stderr, (name, res.stderr)
            assert proc.poll() is None and _status(agent)["level"] == "critical", name
        # `turboctl qos` cannot change the device under the running agent either.
        res = subprocess.run(
            turboctl_argv("qos", "set-rate", "--dev", sandbox.dev, "--netns", sandbox.server, "relax", "1mbit"),
            env=daemon_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 1 and "is managed by a running turbonode agent" in res.stderr, res.stderr
        assert tc(sandbox, "class", "show") == lowered
    finally:
        rc = stop(proc, 30)
        subprocess.run(
            turboctl_argv("qos", "remove", "--dev", sandbox.dev, "--netns", sandbox.server),
            env=daemon_env(),
            capture_output=True,
            timeout=60,
        )
    assert rc == 0, out.text
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".lock")]  # the agent let go of its locks
