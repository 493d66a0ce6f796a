"""`turboctl demo`: the report, the preflight, a real short run, and Ctrl-C/SIGTERM cleaning up."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from sandbox import demo, report
from sandbox.interrupt import checkpoint
from sandbox.node import DemoNode, SandboxWorker
from tests.helpers import daemon_env, needs_bcc, start, turboctl_argv
from turboctl import demo_cmd as demo_cli
from turboctl import main
from turbonode.cgroups import CgroupError, CpuHierarchy

RESULT = {
    "without": {
        "tiers": {"turbo": {"requests": 2, "ok": 2, "rejected": 0, "failed": 0, "p50_s": 8.3, "p99_s": 10.1}},
        "agent": None,
    },
    "with": {
        "tiers": {
            "turbo": {"requests": 5, "ok": 5, "rejected": 0, "failed": 0, "p50_s": 3.9, "p99_s": 5.8},
            "relax": {"requests": 2, "ok": 0, "rejected": 1, "failed": 1, "p50_s": None, "p99_s": None},
        },
        "agent": {
            "max_level": "critical",
            "reasons": ["cpu_load"],
            "throttled_share": 0.5,
            "last_throttle": {"max_batch": 1},
            "levers": {"cpu_share": 0.5, "worker_threads": 0.25},
        },
    },
}


def test_report_is_side_by_side():
    lines = report.comparison(RESULT).splitlines()
    turbo = next(line for line in lines if line.startswith("turbo"))
    assert re.search(r"2/2\s+0\s+8300\s+10100\s+-\s+-\s+5/5\s+0\s+3900\s+5800\s+-\s+-$", turbo), turbo
    relax = next(line for line in lines if line.startswith("relax"))
    assert re.search(r"0/0\s+0\s+-\s+-\s+-\s+-\s+0/2\s+2\s+-\s+-\s+-\s+-$", relax), relax
    assert any("highest level critical (cpu_load)" in line and "50% of the time" in line for line in lines)
    assert any("levers engaged: cpu_share 50%, worker_threads 25%" in line for line in lines)


def test_a_seed_gives_each_worker_its_own_fixed_arrivals():
    """bench/node_slo.py's --seed: worker i's turbo arrivals from seed + i (the same in every
    cell, and not the other workers' bursts); no seed, fresh arrivals. Each load keeps to its
    worker's CPUs."""
    seen: dict[int, tuple[int | None, str]] = {}

    class Node:
        workers = [SandboxWorker("a", 8000, "", "", "0"), SandboxWorker("b", 8001, "", "", "1")]

        def load(self, tiers, probes, rate, nodelay, port, seed, cpus):
            seen[port] = seed, cpus
            return [], 0.0

    DemoNode.load_all(Node(), {"a": {}, "b": {}}, 3, 1.0, seed=22)  # type: ignore[arg-type]
    assert seen == {8000: (22, "0"), 8001: (23, "1")}
    DemoNode.load_all(Node(), {"a": {}, "b": {}}, 3, 1.0)  # type: ignore[arg-type]
    assert seen == {8000: (None, "0"), 8001: (None, "1")}


def test_preflight_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(demo.shutil, "which", lambda name: None if name == "stress-ng" else "/usr/bin/" + name)
    if os.geteuid() != 0:
        pytest.skip("preflight refuses non-root first")
    res = CliRunner().invoke(main, ["demo", "--seconds", "4"])
    assert res.exit_code == 1 and "missing programs: stress-ng" in res.output
    res = CliRunner().invoke(main, ["demo", "--seconds", "1000"])
    assert res.exit_code == 2 and "--seconds" in res.output


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# the interrupt lands this long after "phase 1/2": in the phase's load (its faults start first)
LOAD_UNDER_WAY_S = 6.0
INTERRUPTED_EXIT_S = 20.0  # the phase has 24 s of its 30 left then


def _remove_what_a_killed_demo_left(server: str, client: str, tmp: str) -> None:
    """A demo SIGKILLed by a failing test leaves its node: its processes (by PID: the worker,
    the load), namespaces, cgroups and directory; removed so the next tests start clean."""
    for line in _leftovers(tmp or server or "never-a-match"):
        with contextlib.suppress(psutil.Error):
            psutil.Process(int(line.split(":")[0])).kill()
    for ns in {server, client} & _netns():
        subprocess.run(["ip", "netns", "delete", ns], check=False)
    for top in glob.glob(f"/sys/fs/cgroup/*/{server}-*") if server else ():
        for cgroup, _, _ in os.walk(top, topdown=False):  # the memory one has its roles inside
            with contextlib.suppress(OSError):
                os.rmdir(cgroup)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def _leftovers(tag: str) -> list[str]:
    """Processes whose command line mentions the demo's temp dir or namespaces."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if tag in cmd and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmd}")
    return found


@needs_bcc
@pytest.mark.slow
def test_demo_runs_both_phases_and_cleans_up():
    res = CliRunner().invoke(main, ["demo", "--seconds", "4", "--size", "64", "--json", "--keep-logs"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    for phase in ("without", "with"):
        assert result[phase]["tiers"]["turbo"]["ok"] >= 1, result
    assert result["without"]["agent"] is None and result["with"]["agent"]["max_level"]
    server, client, tmp = re.search(r"netns (\S+) .*netns (\S+) .*logs in (\S+) \(kept\)", res.stderr).groups()
    try:
        assert not ({server, client} & _netns()) and not _leftovers(tmp) and not _cgroups(server)
        # --keep-logs: the path it printed exists, with both daemons' logs
        assert f"logs kept in {tmp}" in res.stderr
        assert "serving" in Path(tmp, "worker.log").read_text() and Path(tmp, "agent.log").stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@needs_bcc
@pytest.mark.slow
def test_demo_with_two_workers_loads_each_under_one_agent_and_cleans_up():
    res = CliRunner().invoke(main, ["demo", "--seconds", "4", "--size", "64", "--workers", "2", "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    for phase in ("without", "with"):
        assert set(result[phase]["workers"]) == {"a", "b"}, result[phase]
        assert all(w["turbo"]["ok"] >= 1 for w in result[phase]["workers"].values()), result[phase]
    assert set(result["with"]["agent"]["workers"]) == {"a", "b"}  # the one agent saw both
    assert "worker a: tiny model serving" in res.stderr and "worker b: tiny model serving" in res.stderr
    server, client = re.search(r"netns (\S+) .*netns (\S+)", res.stderr).groups()
    assert not ({server, client} & _netns()) and not _cgroups(server) and not _demo_dirs(server)
    text = report.comparison(result)
    assert "turbo at worker a:" in text and "turbo at worker b:" in text, text


@needs_bcc
@pytest.mark.slow
def test_demo_runs_without_the_cgroup_lever_where_cgroups_are_read_only():
    """Inside systemd-nspawn on these hosts the v1 controllers are mounted read-only: the demo
    runs without the cgroup lever and says so, instead of stopping. The same mount made
    read-only for real, in a mount namespace of the demo's own (the host's stays writable)."""
    try:
        mount = CpuHierarchy.find().mount
    except CgroupError as exc:
        pytest.skip(f"no cgroup cpu controller: the demo runs without cgroups anyway ({exc})")
    if not shutil.which("unshare"):
        pytest.skip("util-linux's unshare is not installed")
    readonly = f'mount -o remount,bind,ro {mount} && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", readonly, "sh"]
    demo_argv = turboctl_argv("demo", "--seconds", "4", "--size", "64", "--json")
    out = subprocess.run([*argv, *demo_argv], env=daemon_env(), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Read-only file system): running without the cgroup lever" in out.stderr, out.stderr[-4000:]
    result = json.loads(out.stdout)
    assert all(result[phase]["tiers"]["turbo"]["ok"] >= 1 for phase in ("without", "with")), result
    server, client = re.search(r"netns (\S+) .*netns (\S+)", out.stderr).groups()
    assert not ({server, client} & _netns()) and not _cgroups(server)


def _demo_dirs(server: str) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"turbonode-demo-{server}-*"))


def _cgroups(tag: str) -> list[str]:
    """The sandbox node's cgroups (the worker's, the batch one) still there."""
    try:
        h = CpuHierarchy.find()
    except CgroupError:
        return []
    return [d for d in os.listdir(h.mount) if d.startswith(tag)]


@needs_bcc
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_interrupted_removes_everything(sig):
    """Interrupted while its load runs, the demo ends the load generators at once and removes
    everything, well before the phase's 30 s are up (it once sat out the whole phase first)."""
    proc, out = start(turboctl_argv("demo", "--seconds", "30"), daemon_env())
    server = client = tmp = ""
    try:
        assert out.wait_for(r"phase 1/2", 180), out.text
        server, client = re.search(r"netns (\S+) .*netns (\S+)", out.text).groups()
        assert {server, client} <= _netns()
        [tmp] = _demo_dirs(server)
        assert "logs in" not in out.text  # never a path that will not exist
        time.sleep(LOAD_UNDER_WAY_S)
        proc.send_signal(sig)
        t0 = time.monotonic()
        assert proc.wait(60) == 1
        assert time.monotonic() - t0 < INTERRUPTED_EXIT_S, out.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _remove_what_a_killed_demo_left(server, client, tmp)
    assert "interrupted" in out.text
    assert not ({server, client} & _netns()) and not os.path.exists(tmp) and not _leftovers(tmp)
    assert not _cgroups(server)


def test_sigterm_interrupts_only_the_demo_process():
    """A forked child (pyroute2's netns helper) inherits the handler and must just die of SIGTERM,
    not run the demo's cleanup: that once deleted the namespaces under the running demo."""
    handler = demo_cli._interrupt_in(os.getpid())
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGTERM, None)
    pid = os.fork()
    if pid == 0:  # the child: as if it had inherited the handler
        try:
            signal.signal(signal.SIGTERM, handler)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            os._exit(3)  # reached only when the handler raised or returned
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_an_interrupt_a_library_swallowed_still_stops_the_demo_at_its_next_step():
    """The handler raises KeyboardInterrupt and sets the flag the demo checks at every step: a
    SIGINT that landed inside pyroute2 (bare excepts) once let the demo run on into phase 2."""
    stop = threading.Event()
    handler = demo_cli._interrupt_in(os.getpid(), stop)
    try:
        handler(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass  # swallowed, as a library would
    assert stop.is_set()
    with pytest.raises(KeyboardInterrupt):
        checkpoint(stop)
    checkpoint(None)
    checkpoint(threading.Event())  # not set: nothing
