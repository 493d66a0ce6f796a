"""What the agent's tests share: one worker's unit of the agent (its feed, policy and throttle lane)
for a socket, a scrape of one collector through a fresh registry, the agent daemon started and
stopped as a subprocess, and cgroup trees (fake and this host's). The worker stand-in the
agent talks to (MiniWorker) and the procfs it reads (FakeProc) are in tests/helpers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.levers import WorkerLevers
from agent.metrics import WatcherCollector
from agent.policy import DegradationPolicy, Rule
from agent.throttle_lane import ThrottleLane
from agent.watchers.worker import WorkerWatcher
from agent.watchers.worker_feed import WorkerFeed
from agent.worker_unit import WorkerUnit
from bench.node import free_port, wait_for
from tests.helpers import ROOT
from turbonode.cgroups import CgroupError, Hierarchy
from turbonode.config import LeversConfig, WorkerSpec
from turbonode.jsonrpc import ControlClient

H = TypeVar("H", bound=Hierarchy)


def scrape(watcher) -> str:
    """The text exposition of one watcher's collector, from a fresh registry."""
    reg = CollectorRegistry()
    reg.register(WatcherCollector(watcher))
    return generate_latest(reg).decode()


def agent_unit(
    path: str, rules: tuple[Rule, ...] = (), ttl_s: float = 3.0, name: str = "default", timeout: float = 0.5
) -> WorkerUnit:
    """The agent's unit for the worker at `path` (as agent/worker_unit.worker_unit builds it, with
    the rules given), its throttle lane started; `loop.shutdown` or `unit.lane.close` ends it."""
    spec = WorkerSpec(name, path, "", (), "cpu", "", frozenset())
    feed = WorkerWatcher(WorkerFeed(path, {r.signal: r.enter for r in rules}, name=name))
    lane = ThrottleLane(name, ControlClient(path, timeout=timeout), ttl_s).start()
    return WorkerUnit(spec, feed, None, DegradationPolicy(rules), lane, WorkerLevers(LeversConfig(), name))


# ---- the agent daemon ---------------------------------------------------------------------------


def start_agent(tmp_path, worker_sock, extra="", args=()):
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nsocket = "{tmp_path}/agent.sock"\nworker_socket = "{worker_sock}"\n'
        f'metrics = "127.0.0.1:{port}"\nthrottle_ttl = 1.0\n{extra}'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "agent.log", "w") as log:  # a file, not a pipe nobody drains while it runs
        proc = subprocess.Popen(
            [sys.executable, "-m", "turboctl", "agent", "run", "--config", str(cfg), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    proc.log_path = tmp_path / "agent.log"
    agent = ControlClient(f"{tmp_path}/agent.sock", timeout=1.0, peer="agent")

    def ready():
        try:
            return agent.call("status").get("level")
        except Exception:
            return None

    if not wait_for(ready, 20):
        proc.kill()
        proc.wait()
        pytest.fail(f"agent did not come up:\n{proc.log_path.read_text()}")
    return proc, agent, port


def stop_agent(proc) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    return proc.returncode, proc.log_path.read_text()


# ---- cgroups ---------------------------------------------------------------------------------------


def fake_v1(tmp_path: Path, *more: str) -> Path:
    """A hybrid host's v1 cpu tree: the root, `worker`, `batch` and the cgroups `more` names."""
    root = tmp_path / "cgroup"
    for cg in ("", "worker", "batch", *more):
        d = root / "cpu" / cg
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.shares").write_text("1024\n")
        (d / "cpu.cfs_quota_us").write_text("-1\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    (root / "unified").mkdir()
    (root / "unified" / "cgroup.controllers").write_text("\n")  # hybrid: v2 without cpu
    return root


def real_v1(kind: type[H], v2_tests: str) -> H:
    """This host's v1 hierarchy of a controller, for tests of its v1 files (v2's: `v2_tests`)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    try:
        h = kind.find()
    except CgroupError as exc:
        pytest.skip(f"no cgroup {kind.controller} controller to test on: {exc}")
    if h.version != 1:
        pytest.skip(f"the {kind.controller} controller is on cgroup v2 here: these tests are v1's (v2: {v2_tests})")
    return h


# Fake sysfs/procfs/blkio trees for the io levers (agent and doctor tests).
BPS_V1 = "blkio.throttle.write_bps_device"
IOPS_V1 = "blkio.throttle.write_iops_device"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(tmp_path: Path, vda: str = "[mq-deadline] none", nvme: str = "[none] mq-deadline") -> Path:
    """vda (254:0) with a partition vda1 (254:1), and nvme0n1 (259:0), as sysfs links them, with
    their io schedulers (queue/scheduler: `vda`, `nvme`)."""
    sys_ = tmp_path / "sys"
    for disk, dev, parts, sched in (("vda", "254:0", {"vda1": "254:1"}, vda), ("nvme0n1", "259:0", {}, nvme)):
        d = sys_ / "devices/virtual/block" / disk
        write(d / "dev", dev + "\n")
        write(d / "queue/scheduler", sched + "\n")
        links = {disk: (d, dev)}
        for part, pdev in parts.items():
            write(d / part / "dev", pdev + "\n")
            write(d / part / "partition", "1\n")
            links[part] = (d / part, pdev)
        for name, (target, majmin) in links.items():
            (sys_ / "class/block").mkdir(parents=True, exist_ok=True)
            (sys_ / "dev/block").mkdir(parents=True, exist_ok=True)
            (sys_ / "class/block" / name).symlink_to(target)
            (sys_ / "dev/block" / majmin).symlink_to(target)
    return sys_


def fake_procfs(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    write(
        proc / "self/mountinfo",
        "22 1 254:1 / / rw,relatime - ext4 /dev/vda1 rw\n"
        "23 22 0:21 / /proc rw - proc proc rw\n"
        "24 22 254:1 /srv /srv rw - ext4 /dev/vda1 rw\n"  # a bind mount of the same disk: once
        "25 22 259:0 / /data rw - xfs /dev/nvme0n1 rw\n"
        "26 22 7:0 / /snap/x ro - squashfs /dev/loop0 ro\n",  # not in this sysfs: left out
    )
    return proc


def fake_blkio(tmp_path: Path, files: tuple[str, ...] = (BPS_V1, IOPS_V1)) -> Path:
    root = tmp_path / "cgroup"
    write(root / "blkio/blkio.reset_stats", "")
    (root / "blkio/batch").mkdir(parents=True)
    for name in files:
        write(root / "blkio/batch" / name, "")
    (root / "unified").mkdir()
    write(root / "unified/cgroup.controllers", "\n")
    return root
