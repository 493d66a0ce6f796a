"""The CPU-share lever and its journal: on fake v1/v2 trees, on real cgroups, after kill -9."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from agent.levers.cgroup import CpuShare, CpuShareLever, WorkerCgroup, quota_neighbours
from agent.levers.journal import KnobError, KnobJournal, same_value
from render.cpu_threads import available_cpus
from sandbox.cgroup_v2 import unavailable
from tests.agent.helpers import fake_v1
from tests.helpers import kill_9_once
from turbonode.cgroups import CgroupError, CpuHierarchy, shares_from_weight, slice_path
from turbonode.config import LeversConfig


def fake_v2(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for cg in ("system.slice/turbonode-worker.service", "batch.slice"):
        d = root / cg
        d.mkdir(parents=True)
        (d / "cpu.weight").write_text("100\n")
        (d / "cpu.max").write_text("max 100000\n")
    return root


def read(path: Path) -> str:
    return path.read_text().strip()


# ---- pure parts ---------------------------------------------------------------------------


def test_slice_names_and_paths():
    assert slice_path("batch.slice") == "/batch.slice"
    assert slice_path("user-1000.slice") == "/user.slice/user-1000.slice"
    assert slice_path("system.slice/turbonode-worker.service") == "/system.slice/turbonode-worker.service"
    assert slice_path("/batch") == "/batch"


def test_weights_convert_like_systemd():
    assert shares_from_weight(100) == 1024
    assert shares_from_weight(1) == 10
    assert shares_from_weight(10000) == 102400


def test_knob_values_compare_by_fields_and_masks():
    assert same_value("max 100000", "max  100000")
    assert same_value("00000000,00000001", "1")
    assert not same_value("1024", "2")


# ---- fake trees ---------------------------------------------------------------------------


def test_v1_tree_found_on_a_hybrid_host_and_lever_applied_and_undone(tmp_path):
    root = fake_v1(tmp_path)
    h = CpuHierarchy.find(str(root))
    assert (h.version, h.mount) == (1, str(root / "cpu"))
    state = tmp_path / "run" / "levers.json"
    lever = CpuShareLever(h, KnobJournal(str(state)), ("/worker",), ("/batch",), best_effort_cpus=0.5)
    lever.engage()
    assert read(root / "cpu/worker/cpu.shares") == "102400"
    assert read(root / "cpu/batch/cpu.shares") == "10"
    assert read(root / "cpu/batch/cpu.cfs_quota_us") == "50000"
    assert set(json.loads(state.read_text())) == {
        str(root / f)
        for f in (
            "cpu/worker/cpu.shares",
            "cpu/batch/cpu.shares",
            "cpu/batch/cpu.cfs_period_us",
            "cpu/batch/cpu.cfs_quota_us",
        )
    }
    lever.engage()  # idempotent: originals are not overwritten by our own values
    assert lever.release() == []
    assert [read(root / f"cpu/{cg}/cpu.shares") for cg in ("worker", "batch")] == ["1024", "1024"]
    assert read(root / "cpu/batch/cpu.cfs_quota_us") == "-1"
    assert not state.exists()


def test_the_neighbours_that_spend_a_workers_quota_are_capped_while_engaged(tmp_path):
    """A node (a pod, a slice) capped at 0.5 CPU holds the worker and other work: a hog there on
    another CPU spends the node's budget whatever the weights, so cpu_share caps the worker's
    neighbours under that quota at a share of it (bench/capacity.py's fault cell), and puts back."""
    root = fake_v1(tmp_path, "node", "node/worker", "node/other", "node/other/job", "node/batch", "node/tight")
    (root / "cpu/node/cpu.cfs_quota_us").write_text("50000\n")
    (root / "cpu/node/tight/cpu.cfs_quota_us").write_text("1000\n")  # capped tighter by someone: left
    h = CpuHierarchy.find(str(root))
    assert quota_neighbours(h, ["/node/worker"]) == {"/node/other": 0.5, "/node/batch": 0.5, "/node/tight": 0.5}
    assert quota_neighbours(h, ["/worker"]) == {}  # no quota above it: nothing shares one
    state = tmp_path / "levers.json"
    lever = CpuShareLever(h, KnobJournal(str(state)), ("/node/worker",), ("/batch",), neighbour_share=0.1)
    lever.engage()
    quota = {
        cg: read(root / f"cpu/{cg}/cpu.cfs_quota_us")
        for cg in ("node", "node/worker", "node/other", "node/batch", "node/tight", "node/other/job")
    }
    assert quota == {
        "node": "50000",
        "node/worker": "-1",
        "node/other": "5000",
        "node/batch": "5000",
        "node/tight": "1000",
        "node/other/job": "-1",
    }
    assert lever.neighbour_caps() == {"/node/other": 0.05, "/node/batch": 0.05}  # what status reports, once engaged
    lever.engage()  # engaged again: the same
    assert read(root / "cpu/node/other/cpu.cfs_quota_us") == "5000"
    assert lever.release() == []
    assert [read(root / f"cpu/node/{cg}/cpu.cfs_quota_us") for cg in ("other", "batch", "tight")] == [
        "-1",
        "-1",
        "1000",
    ]
    # a best-effort neighbour with a cap of its own gets that one; share 0 leaves the neighbours alone
    lever = CpuShareLever(
        h, KnobJournal(str(state)), ("/node/worker",), ("/node/batch",), best_effort_cpus=0.2, neighbour_share=0.1
    )
    lever.engage()
    assert [read(root / f"cpu/node/{cg}/cpu.cfs_quota_us") for cg in ("other", "batch")] == ["5000", "20000"]
    assert lever.release() == []
    CpuShareLever(h, KnobJournal(str(state)), ("/node/worker",), ()).engage()
    assert read(root / "cpu/node/other/cpu.cfs_quota_us") == "-1"


def test_the_agents_own_cgroup_is_never_capped_as_a_neighbour(tmp_path):
    """An agent beside the worker under the node's quota (a sidecar in its pod; the sandbox node's
    `other`) caps the batch neighbour, never itself: capped at a tenth of the quota, its status
    calls timed out in bench/capacity.py's fault cell."""
    root = fake_v1(tmp_path, "node", "node/worker", "node/agent", "node/batch")
    (root / "cpu/node/cpu.cfs_quota_us").write_text("50000\n")
    procfs = tmp_path / "proc"
    for pid, cg in ((4242, "/node/worker"), (os.getpid(), "/node/agent")):
        (procfs / str(pid)).mkdir(parents=True)
        (procfs / str(pid) / "cgroup").write_text(f"4:cpu,cpuacct:{cg}\n1:name=systemd:/\n")
    cfg = LeversConfig(cgroup_root=str(root), worker_cgroup="auto", quota_neighbour_share=0.1)
    lever = CpuShare(
        cfg, KnobJournal(str(tmp_path / "levers.json")), [WorkerCgroup("default", "auto", lambda: 4242)], str(procfs)
    )
    assert lever.engage()["quota_neighbours"] == {"/node/batch": 0.05}
    assert [read(root / f"cpu/node/{cg}/cpu.cfs_quota_us") for cg in ("agent", "batch")] == ["-1", "5000"]
    assert lever.release() == []
    assert read(root / "cpu/node/batch/cpu.cfs_quota_us") == "-1"
    h = CpuHierarchy.find(str(root))
    assert quota_neighbours(h, ["/node/worker"], spared=["/node/agent"]) == {"/node/batch": 0.5}


def test_v2_tree_uses_cpu_weight_and_cpu_max(tmp_path):
    root = fake_v2(tmp_path)
    h = CpuHierarchy.find(str(root))
    assert h.version == 2
    lever = CpuShareLever(
        h,
        KnobJournal(str(tmp_path / "levers.json")),
        ("system.slice/turbonode-worker.service",),
        ("batch.slice",),
        worker_weight=1000,
        best_effort_weight=5,
        best_effort_cpus=0.25,
    )
    lever.engage()
    assert read(root / "system.slice/turbonode-worker.service/cpu.weight") == "1000"
    assert read(root / "batch.slice/cpu.weight") == "5"
    assert read(root / "batch.slice/cpu.max") == "25000 100000"
    lever.release()
    assert read(root / "batch.slice/cpu.max") == "max 100000"
    assert read(root / "batch.slice/cpu.weight") == "100"


def test_cgroup_of_a_pid_from_procfs(tmp_path):
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/x\n1:cpu,cpuacct:/system.slice/w.service\n0::/unified/w\n")
    v1 = CpuHierarchy(str(tmp_path), 1)
    v2 = CpuHierarchy(str(tmp_path), 2)
    assert v1.of_pid(42, str(tmp_path / "proc")) == "/system.slice/w.service"
    assert v2.of_pid(42, str(tmp_path / "proc")) == "/unified/w"
    with pytest.raises(CgroupError, match="pid 43"):
        v1.of_pid(43, str(tmp_path / "proc"))


def test_no_cpu_controller_and_missing_cgroup_are_named(tmp_path):
    with pytest.raises(CgroupError, match="no cgroup cpu controller"):
        CpuHierarchy.find(str(tmp_path))
    h = CpuHierarchy.find(str(fake_v1(tmp_path)))
    lever = CpuShareLever(h, KnobJournal(str(tmp_path / "s.json")), ("/worker",), ("batch.slice",))
    with pytest.raises(CgroupError, match="batch.slice does not exist"):
        lever.engage()


def test_a_refused_write_leaves_no_journal_entry(tmp_path):
    knob = tmp_path / "knob"
    knob.mkdir()  # reading a directory fails like a vanished file
    journal = KnobJournal(str(tmp_path / "s.json"))
    with pytest.raises(KnobError, match="cannot read"):
        journal.set(str(knob), "1")
    f = tmp_path / "ro"
    f.write_text("5\n")
    f.chmod(0o444)
    if os.geteuid() != 0:  # root writes through a read-only mode
        with pytest.raises(KnobError, match="cannot write"):
            journal.set(str(f), "1")
    assert journal.entries == {} and not (tmp_path / "s.json").exists()


def test_a_knob_changed_by_someone_else_is_left_alone(tmp_path):
    f = tmp_path / "cpu.shares"
    f.write_text("1024\n")
    journal = KnobJournal(str(tmp_path / "s.json"))
    journal.set(str(f), "2")
    f.write_text("512\n")  # an operator changed it meanwhile
    problems = journal.undo_all()
    assert len(problems) == 1 and "someone else" in problems[0]
    assert read(f) == "512"


def test_leftovers_restored_and_a_broken_state_file_reported(tmp_path):
    f = tmp_path / "knob"
    f.write_text("7\n")
    state = tmp_path / "s.json"
    KnobJournal(str(state)).set(str(f), "9")  # the agent "dies" here: its journal is gone
    assert read(f) == "9" and state.exists()
    assert KnobJournal(str(state)).restore_leftovers() == []
    assert read(f) == "7" and not state.exists()
    state.write_text("{not json")
    problems = KnobJournal(str(state)).restore_leftovers()
    assert "unreadable state file" in problems[0] and not state.exists()


# ---- real cgroups -------------------------------------------------------------------------


def test_real_cgroups_applied_and_undone(real_cgroups, tmp_path):
    h, (worker, batch) = real_cgroups
    weight = [Path(h.weight_file(cg)[0]) for cg in (worker, batch)]
    before = [read(p) for p in weight]
    lever = CpuShareLever(h, KnobJournal(str(tmp_path / "levers.json")), (worker,), (batch,), best_effort_cpus=0.5)
    lever.engage()
    assert [read(p) for p in weight] == [h.weight_value(10000), h.weight_value(1)]
    quota = h.quota_writes(batch, 0.5)
    assert all(same_value(read(Path(f)), v) for f, v in quota)
    assert lever.release() == []
    assert [read(p) for p in weight] == before
    assert all(not same_value(read(Path(f)), v) or f.endswith("period_us") for f, v in quota)


def test_real_quota_neighbours_capped_and_put_back(hierarchy, tmp_path):
    """The kernel takes the neighbours' caps under a real quota'd parent (v1 refuses a child's
    quota above its parent's) and the lever puts them back."""
    h = hierarchy
    node = f"/tn-test-{uuid.uuid4().hex[:8]}-node"
    made = []
    try:
        for cg in (node, f"{node}/worker", f"{node}/other"):
            h.create(cg)
            made.append(cg)
            if cg == node and h.version == 2:  # its children get cpu.max once it hands them the controller
                Path(h.file(node, "cgroup.subtree_control")).write_text("+cpu")
        for f, v in h.quota_writes(node, 0.5):
            Path(f).write_text(v)
        other = h.quota_writes(f"{node}/other", 0.05)
        before = [read(Path(f)) for f, _ in other]
        lever = CpuShareLever(
            h, KnobJournal(str(tmp_path / "levers.json")), (f"{node}/worker",), (), neighbour_share=0.1
        )
        lever.engage()
        assert all(same_value(read(Path(f)), v) for f, v in other)
        assert lever.release() == []
        assert [read(Path(f)) for f, _ in other] == before
    finally:
        for cg in reversed(made):
            h.remove(cg)


def test_real_cgroups_restored_at_next_start_after_kill_9(real_cgroups, tmp_path):
    h, (worker, batch) = real_cgroups
    state = tmp_path / "levers.json"
    weight = [Path(h.weight_file(cg)[0]) for cg in (worker, batch)]
    before = [read(p) for p in weight]
    agent = textwrap.dedent(f"""
        import time
        from agent.levers.cgroup import CpuShare, CpuShareLever
        from turbonode.cgroups import CpuHierarchy
        from agent.levers.journal import KnobJournal
        lever = CpuShareLever(CpuHierarchy({h.mount!r}, {h.version}), KnobJournal({str(state)!r}),
                              ({worker!r},), ({batch!r},), best_effort_cpus=0.25)
        lever.engage()
        print("engaged", flush=True)
        time.sleep(60)
    """)
    kill_9_once(agent)
    assert [read(p) for p in weight] != before  # the dead agent left them changed
    assert KnobJournal(str(state)).restore_leftovers() == []
    assert [read(p) for p in weight] == before
    assert not state.exists()


def _in_cgroup(h: CpuHierarchy, cgroup: str) -> subprocess.Popen:
    """A real process (sleeping) moved into `cgroup`, as systemd starts the worker in its unit's."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(h.procs_file(cgroup)).write_text(str(proc.pid))
    return proc


def test_the_worker_cgroup_found_from_its_pid_is_weighed_and_its_quota_read(real_cgroups, tmp_path):
    """levers.worker_cgroup = "auto": the worker's cgroup from /proc/PID/cgroup, raised and restored;
    the worker sizes its threads to the quota of the same cgroup (render/cpu_threads.py)."""
    h, (worker, batch) = real_cgroups
    proc = _in_cgroup(h, worker)
    try:
        assert h.of_pid(proc.pid) == worker
        cfg = LeversConfig(cgroup_root="/sys/fs/cgroup", worker_cgroup="auto", best_effort_cgroups=[batch])
        journal = KnobJournal(str(tmp_path / "levers.json"))
        lever = CpuShare(cfg, journal, [WorkerCgroup("default", cfg.worker_cgroup, lambda: proc.pid)], "/proc")
        weight = Path(h.weight_file(worker)[0])
        before = read(weight)
        assert lever.engage() == {
            "cgroup_version": h.version,
            "worker_cgroups": {"default": worker},
            "best_effort": (batch,),
            "quota_neighbours": {},  # no quota above the worker here
            "unresolved": {},
        }
        assert read(weight) == h.weight_value(10000) == ("10000" if h.version == 2 else "102400")
        assert lever.release() == [] and read(weight) == before
        for path, value in h.quota_writes(worker, 0.5):
            Path(path).write_text(value)
        assert available_cpus(pid=proc.pid) == 0.5
    finally:
        proc.kill()
        proc.wait()


def test_where_the_cpu_controller_cannot_move_to_v2_says_why(tmp_path):
    """The checks made before anything is unmounted, on a fake tree and mountinfo (as root)."""
    if os.geteuid() != 0:
        pytest.skip("the checks start with root")
    root, info = tmp_path / "cgroup", tmp_path / "mountinfo"
    (root / "cpu").mkdir(parents=True)
    (root / "unified").mkdir()

    def mounts(*lines: str) -> str:
        info.write_text(
            "".join(f"{i} 1 0:{i} / {root}/{m} rw - {t} cgroup rw,{o}\n" for i, (m, t, o) in enumerate(lines))
        )
        return unavailable(str(root), str(info))

    assert "not a hybrid host" in mounts(("cpu", "cgroup", "cpu"))
    assert "no cgroup v1 cpu controller mounted alone" in mounts(
        ("cpu", "cgroup", "cpu,cpuacct"), ("unified", "cgroup2", "")
    )
    assert mounts(("cpu", "cgroup", "cpu"), ("unified", "cgroup2", "")) is None
    (root / "cpu" / "batch").mkdir()
    assert "child cgroups (batch)" in mounts(("cpu", "cgroup", "cpu"), ("unified", "cgroup2", ""))
