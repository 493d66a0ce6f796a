"""turboctl's worker commands: CliRunner against real servers, and `worker run` as a real daemon."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from click.testing import CliRunner
from PIL import Image

from render.front.control_server import ControlHandlers, ControlServer
from render.gc_telemetry import GcMonitor
from tests.helpers import ROOT
from tests.render.helpers import make_engine, serve
from turboctl import main
from turbonode.jsonrpc import ControlClient

TURBOCTL = [sys.executable, "-c", "from turboctl import main; main()"]


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, turboctl; sys.exit(1 if 'torch' in sys.modules else 0)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode == 0


@pytest.fixture
def control_path(tmp_path):
    engine = make_engine()
    path = str(tmp_path / "w.sock")
    server = ControlServer(path, ControlHandlers(engine, GcMonitor())).start()
    yield path
    server.close()


def test_ping_status_throttle_release(control_path):
    runner = CliRunner()
    obj = ControlClient(control_path)  # the context object the commands use
    r = runner.invoke(main, ["worker", "ping", "--json"], obj=obj)
    assert r.exit_code == 0 and json.loads(r.output)["pong"] is True
    r = runner.invoke(
        main,
        [
            "throttle",
            "--max-batch",
            "2",
            "--pause",
            "relax",
            "--step-cap",
            "other=5",
            "--shed",
            "fast",
            "--threads",
            "1",
            "--reason",
            "cli test",
            "--ttl",
            "30",
            "--json",
        ],
        obj=obj,
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["step_caps"] == {"other": 5} and json.loads(r.output)["intra_op_threads"] == 1
    r = runner.invoke(main, ["worker", "status", "--socket", control_path])  # --socket instead of obj
    assert r.exit_code == 0 and "throttle: cli test" in r.output and "relax" in r.output
    r = runner.invoke(main, ["worker", "status", "--json"], obj=obj)
    st = json.loads(r.output)
    assert st["max_batch"] == 2 and st["throttle"]["paused_tiers"] == ["relax"]
    r = runner.invoke(main, ["release", "--reason", "done"], obj=obj)
    assert r.exit_code == 0 and r.output.strip() == "released"
    r = runner.invoke(main, ["release", "--json"], obj=obj)
    assert json.loads(r.output)["released"] is False


def test_throttle_errors(control_path, tmp_path):
    runner = CliRunner()
    obj = ControlClient(control_path)
    r = runner.invoke(main, ["throttle", "--pause", "turbo", "--reason", "x"], obj=obj)
    assert r.exit_code == 1 and "turbo tier cannot be throttled" in r.output
    r = runner.invoke(main, ["throttle", "--step-cap", "relax=none", "--reason", "x"], obj=obj)
    assert r.exit_code == 2 and "TIER=STEPS" in r.output
    r = runner.invoke(main, ["throttle", "--max-batch", "2"], obj=obj)
    assert r.exit_code == 2 and "--reason" in r.output
    r = runner.invoke(main, ["worker", "ping", "--socket", str(tmp_path / "absent.sock")])
    assert r.exit_code == 1 and "does not exist" in r.output


def test_render_writes_png(tmp_path):
    runner = CliRunner()
    with serve() as s:
        out = tmp_path / "cat.png"
        r = runner.invoke(
            main,
            [
                "render",
                "a cat",
                "--tier",
                "turbo",
                "--out",
                str(out),
                "--url",
                s.url,
                "--size",
                "64x64",
                "--steps",
                "2",
                "--seed",
                "5",
                "--json",
            ],
        )
        assert r.exit_code == 0, r.output
        meta = json.loads(r.stdout)  # progress went to stderr
        assert meta["tier"] == "turbo" and meta["seed"] == 5 and meta["files"] == [str(out)]
        assert Image.open(out).size == (64, 64)
        r = runner.invoke(
            main,
            [
                "render",
                "two",
                "-n",
                "2",
                "--out",
                str(tmp_path / "two.png"),
                "--url",
                s.url,
                "--size",
                "64x64",
                "--steps",
                "1",
            ],
        )
        assert r.exit_code == 0 and (tmp_path / "two-1.png").exists() and (tmp_path / "two-2.png").exists()
        r = runner.invoke(main, ["render", "bad", "--url", s.url, "--size", "65x64", "--out", str(out)])
        assert r.exit_code == 1 and "worker answered 400" in r.output and "multiples of 16" in r.output
    r = runner.invoke(main, ["render", "x", "--url", "http://127.0.0.1:9", "--out", str(out)])
    assert r.exit_code == 1 and "cannot reach the worker" in r.output


def test_worker_run_reports_bad_config_and_bad_model(tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker]\nmax_batch = 0\n")
    r = runner.invoke(main, ["worker", "run", "--config", str(bad)])
    assert r.exit_code == 1 and "worker.max_batch" in r.output
    r = runner.invoke(main, ["worker", "run", "--listen", "nowhere"])
    assert r.exit_code == 1 and "worker.listen" in r.output
    r = runner.invoke(
        main,
        [
            "worker",
            "run",
            "--model",
            str(tmp_path / "no-model"),
            "--control",
            str(tmp_path / "c.sock"),
            "--listen",
            "127.0.0.1:0",
        ],
    )
    assert r.exit_code == 1 and "neither one of tiny, tiny-sdxl, tiny-sd3, tiny-flux nor a directory" in r.output
    # a sampler the model's family cannot use: refused by its key before anything is served
    flux = tmp_path / "flux.toml"
    flux.write_text('[worker]\nmodel = "tiny-flux"\nsampler = { relax = "dpmpp_2m" }\n')
    r = runner.invoke(main, ["worker", "run", "--config", str(flux), "--control", str(tmp_path / "f.sock")])
    assert r.exit_code == 1 and "worker.sampler.relax: sampler 'dpmpp_2m' does not apply to flux models" in r.output


def _post(url, body, results, key):
    req = urllib.request.Request(
        url + "/v1/images/generations", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            results[key] = (resp.status, json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        results[key] = (exc.code, json.loads(exc.read()))


@pytest.mark.slow
def test_daemon_ready_sigterm_finishes_running_and_fails_queued(tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(120)
    control = str(tmp_path / "run" / "worker.sock")
    # A drain long enough for the 80-step job on a loaded machine: this test is about what
    # SIGTERM does to a running and a queued job, not about the drain timeout.
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "NOTIFY_SOCKET": str(tmp_path / "notify"),
        "TURBONODE_WORKER_DRAIN_TIMEOUT": "600",
    }
    proc = subprocess.Popen(
        [*TURBOCTL, "worker", "run", "--model", "tiny", "--listen", "127.0.0.1:0", "--control", control],
        env=env,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the worker listens before it loads; while it loads, `systemctl status` says so; then READY
        assert notify.recv(4096).startswith(b"STATUS=listening on http://")
        assert notify.recv(4096) == b"STATUS=loading model tiny"
        while b"READY=1" not in notify.recv(4096):
            pass
        # log lines (e.g. backend auto's fallback notice) may come before the ready line
        found = None
        for line in iter(proc.stderr.readline, ""):
            if found := re.search(r"http://[\d.]+:\d+", line):
                break
        url = found.group(0)
        client = ControlClient(control)
        client.call("throttle", paused_tiers=["relax"], reason="keep relax queued", ttl_s=120)
        results = {}
        queued = threading.Thread(
            target=_post, args=(url, {"prompt": "q", "size": "64x64", "tier": "relax"}, results, "queued")
        )
        running = threading.Thread(
            target=_post, args=(url, {"prompt": "r", "size": "64x64", "tier": "other", "steps": 80}, results, "running")
        )
        queued.start()
        running.start()
        # SIGTERM only once one job runs and one waits: on a loaded machine the first step can
        # take seconds to start, and a job still queued at SIGTERM is (rightly) failed.
        deadline = time.monotonic() + 60
        while True:
            tiers = client.call("status")["tiers"]
            if tiers["other"]["in_flight"] == 1 and tiers["relax"]["queued"] == 1:
                break
            assert time.monotonic() < deadline, f"jobs never reached running + queued: {tiers}"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert b"STOPPING=1" in notify.recv(4096)
        queued.join(600)
        running.join(600)
        assert proc.wait(600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
    assert results["running"][0] == 200 and results["running"][1]["turbonode"]["steps"] == 80
    status, body = results["queued"]
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert not os.path.exists(control)
