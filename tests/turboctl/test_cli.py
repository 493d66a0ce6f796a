"""turboctl as an operator uses it: `doctor` registered, `status` with a part down, `render`
with progress, bounded retries on 429 and --async, and rates shown in bit/s."""

from __future__ import annotations

import json
import re
import time

import pytest
from click.testing import CliRunner

from render.front.control_server import ControlHandlers, ControlServer
from render.gc_telemetry import GcMonitor
from tests.helpers import needs_bcc
from tests.render.helpers import serve
from turboctl import main
from turbonode.rpc_server import UnixRpcServer


def test_doctor_is_a_turboctl_command(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[worker]\ndevice = "cpu"\ncontrol_socket = "{tmp_path}/w.sock"\n')
    res = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--json"])
    checks = {c["name"]: c["status"] for c in json.loads(res.stdout)["checks"]}
    assert checks["configuration"] == "ok" and checks["worker.device"] == "ok" and "bpf syscall" in checks


# ---- status: each part, and which one does not answer ----------------------------------------------

AGENT = {"level": "pressured", "active": [], "watchers": {}, "actions": {}, "workers": {"default": {"state": "ok"}}}


def test_status_with_the_agent_down_shows_the_worker(tmp_path):
    with serve() as s:
        handlers = ControlHandlers(s.engine, GcMonitor(), readiness=lambda tier: s.api.readiness(tier))
        server = ControlServer(str(tmp_path / "w.sock"), handlers).start()
        s.engine.throttle.set(unready_tiers=["turbo"], reason="level critical", ttl_s=30)
        args = ["status", "--socket", str(tmp_path / "agent.sock"), "--worker-socket", str(tmp_path / "w.sock")]
        try:
            res = CliRunner().invoke(main, args)
            js = CliRunner().invoke(main, [*args, "--json"])
        finally:
            server.close()
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("agent:    unreachable:") and "is the agent running" in lines[0]
    assert any(line.startswith("worker default: ok") and "backend torch on cpu" in line for line in lines), res.output
    ready = next(line for line in lines if line.startswith("ready:"))
    assert "turbo not ready (the node's agent: level critical)" in ready and "fast ready" in ready
    assert "throttle: " in res.output and "unready_tiers=['turbo']" in res.output
    parts = json.loads(js.stdout)
    assert "error" in parts["agent"] and parts["workers"]["default"]["ready"]["turbo"]["ready"] is False


def test_status_with_both_parts_up_and_both_down(tmp_path):
    agent = UnixRpcServer(str(tmp_path / "a.sock"), {"status": lambda: AGENT}).start()
    worker = UnixRpcServer(
        str(tmp_path / "w.sock"), {"status": lambda: {"backend": {"name": "torch", "device": "cpu"}, "uptime_s": 3}}
    ).start()
    try:
        res = CliRunner().invoke(
            main, ["status", "--socket", str(tmp_path / "a.sock"), "--worker-socket", str(tmp_path / "w.sock")]
        )
    finally:
        agent.close()
        worker.close()
    assert res.exit_code == 0, res.output
    assert "agent:    ok" in res.output and "level:    pressured" in res.output and "worker default: ok" in res.output
    res = CliRunner().invoke(
        main, ["status", "--socket", str(tmp_path / "a.sock"), "--worker-socket", str(tmp_path / "w.sock")]
    )
    assert res.exit_code == 1
    assert re.search(r"^agent: +unreachable", res.output, re.M) and re.search(
        r"^worker default: +unreachable", res.output, re.M
    )


# ---- render -----------------------------------------------------------------------------------------


def test_render_shows_progress_and_async_returns_the_job_id(tmp_path):
    with serve(max_batch=1) as s:
        out = tmp_path / "slow.png"
        res = CliRunner().invoke(
            main, ["render", "slow", "--url", s.url, "--size", "64x64", "--steps", "40", "--out", str(out)]
        )
        assert res.exit_code == 0, res.output
        steps = [int(n) for n in re.findall(r"step (\d+) of 40", res.stderr)]
        assert steps and steps == sorted(steps) and "wrote" in res.stdout and out.exists(), res.stderr
        res = CliRunner().invoke(main, ["render", "later", "--url", s.url, "--size", "64x64", "--async"])
        job_id = res.stdout.strip()
        assert res.exit_code == 0 and re.fullmatch(r"job-[0-9a-f]+", job_id), res.output
        assert s.engine.get(job_id) is not None


def test_render_waits_and_retries_on_429_then_gives_up_when_told(tmp_path):
    with serve() as s:
        s.engine.throttle.set(shed_tiers=["relax"], reason="test: shed", ttl_s=1.5)
        args = ["render", "r", "--tier", "relax", "--url", s.url, "--size", "64x64", "--steps", "1"]
        res = CliRunner().invoke(main, [*args, "--retries", "0", "--out", str(tmp_path / "a.png")])
        assert res.exit_code == 1 and "worker answered 429" in res.output and "retry after" in res.output
        start = time.monotonic()
        res = CliRunner().invoke(main, [*args, "--retries", "3", "--out", str(tmp_path / "b.png")])
        assert res.exit_code == 0, res.output
    assert "retrying in" in res.stderr and "(1 of 3)" in res.stderr
    assert time.monotonic() - start >= 1.0  # it waited for the lease to run out, as Retry-After said


# ---- rates in bit/s ---------------------------------------------------------------------------------


@needs_bcc
def test_qos_prints_the_effective_rate_in_bits(sandbox):
    target = ["--dev", sandbox.dev, "--netns", sandbox.server]
    try:
        res = CliRunner().invoke(main, ["qos", "apply", *target, "--rate", "100mbps"])
        assert res.exit_code == 0, res.output
        assert "link 800mbit (800,000,000 bit/s)" in res.output  # tc's mbps: megabytes per second
        res = CliRunner().invoke(main, ["qos", "show", *target])
        assert "link 800mbit (800,000,000 bit/s)" in res.output
    finally:
        CliRunner().invoke(main, ["qos", "remove", *target])


@pytest.mark.parametrize("text,bits", [("100mbit", 100_000_000), ("100Mbps", 800_000_000), ("1gbit", 10**9)])
def test_rates_follow_tc(text, bits):
    from turbonode.rates import describe_rate, parse_rate

    assert parse_rate(text) == bits and f"({bits:,} bit/s)" in describe_rate(bits)


def test_status_says_loading_while_the_worker_loads(tmp_path):
    from render.front.daemon import loading_handlers

    worker = UnixRpcServer(str(tmp_path / "w.sock"), loading_handlers()).start()
    try:
        res = CliRunner().invoke(
            main, ["status", "--socket", str(tmp_path / "a.sock"), "--worker-socket", str(tmp_path / "w.sock")]
        )
    finally:
        worker.close()
    assert "worker default: loading: " in res.output and "loading its model" in res.output and res.exit_code == 1
