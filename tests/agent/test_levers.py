"""The agent's levers end to end: a running agent (`turboctl agent run`) engages cpu_share on real
cgroups and worker_threads in the worker's throttle when CPU load rises (a procfs the test
drives, tests/helpers.FakeProc), reports them (status, metrics), releases them on
recovery and when it stops, and a new agent puts back what an agent killed with -9 left. The
Levers object alone: dry-run writes nothing, a lever that cannot engage is reported and retried.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from agent.levers import Levers, WorkerLevers
from agent.levers.cgroup import WorkerCgroup
from bench.node import wait_for
from tests.agent.helpers import fake_v1, start_agent, stop_agent
from tests.helpers import FakeProc
from turbonode.cgroups import CpuHierarchy
from turbonode.config import LeversConfig


def read(path: str) -> str:
    return Path(path).read_text().strip()


@pytest.mark.slow
def test_agent_engages_reports_releases_and_restores_after_kill_9(tmp_path, worker, real_cgroups):
    h, (worker_cg, batch_cg) = real_cgroups
    files = [h.weight_file(worker_cg)[0], h.weight_file(batch_cg)[0], *(f for f, _ in h.quota_writes(batch_cg, 1))]
    original = [read(f) for f in files]
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    fake = FakeProc(proc_root)
    toml = (
        f'procfs = "{proc_root}"\n[policy]\nexit_s = 1.0\nmin_change_interval = 0.5\n'
        'disabled = ["netrx_cpu_share", "netrx_latency_p99_s"]\n'
        '[node]\nname = "tn-lv"\n'
        f'[levers]\nworker_cgroup = "{worker_cg}"\nbest_effort_cgroups = ["{batch_cg}"]\nbest_effort_cpus = 0.5\n'
    )
    engaged = [h.weight_value(10000), h.weight_value(1), *(v for _, v in h.quota_writes(batch_cg, 0.5))]

    def status():
        return agent.call("status")["actions"]["levers"]

    def worker_levers():
        return agent.call("status")["workers"]["default"]["levers"]

    proc, agent, port = start_agent(tmp_path, tmp_path / "worker.sock", toml)
    try:
        fake.busy = 0.9
        assert wait_for(lambda: status()["cpu_share"]["engaged"], 5), status()
        assert [read(f) for f in files] == engaged
        levers = status()
        assert worker_levers()["worker_threads"]["engaged"] and "cpu_load=0.9 > 0.35" in levers["cpu_share"]["reason"]
        assert levers["cpu_share"]["worker_cgroups"] == {"default": worker_cg} and set(levers["changed"]) == set(files)
        assert wait_for(lambda: (worker.throttle_state or {}).get("intra_op_threads") == 1, 3)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'turbonode_lever_engaged{lever="cpu_share",node="tn-lv",worker=""} 1.0' in text
        assert 'turbonode_lever_engaged{lever="worker_threads",node="tn-lv",worker="default"} 1.0' in text
        engage = 'turbonode_throttle_actions_total{action="cpu_share_engage",node="tn-lv",reason="cpu_load",worker=""}'
        assert f"{engage} 1.0" in text
        fake.busy = 0.2  # recovery: released, the files as they were
        assert wait_for(lambda: not status()["cpu_share"]["engaged"], 10), status()
        assert [read(f) for f in files] == original and status()["changed"] == {}
        fake.busy = 0.9  # engaged again, then the agent is killed: nothing undoes it...
        assert wait_for(lambda: status()["cpu_share"]["engaged"], 5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        assert [read(f) for f in files] == engaged and (tmp_path / "levers.json").exists()
        fake.busy = 0.2
        proc, agent, port = start_agent(tmp_path, tmp_path / "worker.sock", toml)  # ...until the next agent starts
        assert [read(f) for f in files] == original and not (tmp_path / "levers.json").exists()
        assert status()["restore_problems"] == []
        fake.busy = 0.9
        assert wait_for(lambda: status()["cpu_share"]["engaged"], 5)
        rc, out = stop_agent(proc)  # SIGTERM: releases every lever on the way out
        assert rc == 0, out
        assert [read(f) for f in files] == original
    finally:
        if proc.poll() is None:
            stop_agent(proc)
        fake.close()


def test_dry_run_writes_nothing_and_a_failing_lever_is_reported_and_retried(tmp_path):
    root = fake_v1(tmp_path)
    cfg = LeversConfig(cgroup_root=str(root), worker_cgroup="/worker", best_effort_cgroups=["/batch"])
    state = str(tmp_path / "run" / "levers.json")
    worker = [WorkerCgroup("default", cfg.worker_cgroup, lambda: 1)]
    dry = Levers(cfg, state, worker, dry_run=True)
    assert dry.reconcile({"cpu_share": "cpu_load=0.9 > 0.75"}, {"cpu_share": "cpu_load"}, "recovery") == [
        ("cpu_share_engage", "cpu_load")
    ]
    assert read(str(root / "cpu/worker/cpu.shares")) == "1024" and dry.status()["changed"] == {}
    missing = LeversConfig(cgroup_root=str(root), worker_cgroup="/gone", best_effort_cgroups=[])
    levers = Levers(missing, state, [WorkerCgroup("default", missing.worker_cgroup, lambda: 1)])
    for _ in range(2):  # not engaged: tried again at every sample, reported each time
        assert levers.reconcile({"cpu_share": "x"}, {"cpu_share": "cpu_load"}, "recovery") == []
        assert "cgroup /gone does not exist" in levers.status()["cpu_share"]["error"]
    ok = Levers(cfg, state, worker)
    assert ok.reconcile({"cpu_share": "x"}, {}, "recovery") == [("cpu_share_engage", "")]
    assert read(str(root / "cpu/worker/cpu.shares")) == "102400"
    assert json.loads(Path(state).read_text())
    assert ok.reconcile({}, {}, "shutdown") == [("cpu_share_release", "shutdown")]
    assert read(str(root / "cpu/worker/cpu.shares")) == "1024"
    threads = WorkerLevers(cfg, "default")  # a worker's own: a field of its throttle, no knob
    assert threads.reconcile({"worker_threads": "x"}, {}, "recovery") == [("worker_threads_engage", "")]
    assert threads.throttle_fields() == {"intra_op_threads": 1}
    assert threads.reconcile({}, {}, "shutdown") == [("worker_threads_release", "shutdown")]
    assert threads.throttle_fields() == {}


def test_auto_finds_the_worker_cgroup_and_the_root_cgroup_has_no_weight(tmp_path):
    root = fake_v1(tmp_path)
    procfs = tmp_path / "proc"
    (procfs / "7").mkdir(parents=True)
    (procfs / "7" / "cgroup").write_text("1:cpu,cpuacct:/worker\n")
    (procfs / "8").mkdir(parents=True)
    (procfs / "8" / "cgroup").write_text("1:cpu,cpuacct:/\n")
    cfg = LeversConfig(cgroup_root=str(root))
    levers = Levers(cfg, str(tmp_path / "s.json"), [WorkerCgroup("default", "auto", lambda: 7)], procfs=str(procfs))
    levers.reconcile({"cpu_share": "x"}, {}, "recovery")
    assert levers.status()["cpu_share"]["worker_cgroups"] == {"default": "/worker"}
    assert read(str(root / "cpu/worker/cpu.shares")) == "102400"
    levers.reconcile({}, {}, "recovery")
    in_root = Levers(cfg, str(tmp_path / "s.json"), [WorkerCgroup("default", "auto", lambda: 8)], procfs=str(procfs))
    in_root.reconcile({"cpu_share": "x"}, {}, "recovery")
    assert "nothing to weigh" in in_root.status()["cpu_share"]["error"]
    assert CpuHierarchy.find(str(root)).version == 1


def test_cpu_share_raises_every_workers_cgroup_and_finds_a_late_one(tmp_path, monkeypatch):
    """Several workers: each one's cgroup is raised; one that has not answered yet (no pid) leaves
    the others raised, and is raised once it answers, while the lever stays engaged."""
    import agent.levers.cgroup as cgroup_lever

    root = fake_v1(tmp_path)
    (root / "cpu/worker-b").mkdir()
    (root / "cpu/worker-b/cpu.shares").write_text("1024\n")
    procfs = tmp_path / "proc"
    for pid, cg in ((7, "/worker"), (9, "/worker-b")):
        (procfs / str(pid)).mkdir(parents=True)
        (procfs / str(pid) / "cgroup").write_text(f"1:cpu,cpuacct:{cg}\n")
    pids: dict[str, int | None] = {"a": 7, "b": None}
    workers = [WorkerCgroup(n, "auto", lambda n=n: pids[n]) for n in ("a", "b")]
    levers = Levers(LeversConfig(cgroup_root=str(root)), str(tmp_path / "s.json"), workers, procfs=str(procfs))
    levers.reconcile({"cpu_share": "x"}, {}, "recovery")
    st = levers.status()["cpu_share"]
    assert st["engaged"] and st["worker_cgroups"] == {"a": "/worker"} and "pid is not known" in st["unresolved"]["b"]
    assert read(str(root / "cpu/worker/cpu.shares")) == "102400"
    assert read(str(root / "cpu/worker-b/cpu.shares")) == "1024"
    pids["b"] = 9  # b answers; a second later the engaged lever finds its cgroup
    monkeypatch.setattr(cgroup_lever, "RESOLVE_RETRY_S", 0.0)
    levers.reconcile({"cpu_share": "x"}, {}, "recovery")
    assert levers.status()["cpu_share"]["worker_cgroups"] == {"a": "/worker", "b": "/worker-b"}
    assert read(str(root / "cpu/worker-b/cpu.shares")) == "102400"
    levers.reconcile({}, {}, "recovery")  # released: both back
    assert read(str(root / "cpu/worker/cpu.shares")) == read(str(root / "cpu/worker-b/cpu.shares")) == "1024"
