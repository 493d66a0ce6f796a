"""The memory and io controllers' knobs (turbonode/memory_cgroups.py), the journal's keyed and
per-process knobs, and the memory levers and watcher, on fake v1/v2 trees and fake /proc trees.
The real-cgroup and real-process halves are in tests/agent/test_memory_pressure.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.levers import Levers
from agent.levers.cgroup import WorkerCgroup
from agent.levers.io import IoWeight
from agent.levers.journal import KnobError, KnobJournal, KnobWrites, read_knob
from agent.levers.memory import MemoryProtect, MemorySqueeze, OomGuard
from agent.watchers.memory import MemoryWatcher, process_major_faults
from agent.watchers.procfile import process_stat_fields
from tests.agent.helpers import fake_procfs, fake_sysfs
from turbonode.cgroups import CgroupError
from turbonode.config import LeversConfig
from turbonode.memory_cgroups import PAGE, IoHierarchy, MemoryHierarchy, keyed, psi_file

OOM_CONTROL_V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def read(path: Path) -> str:
    return path.read_text().strip()


def fake_v1(tmp_path: Path) -> Path:
    """A hybrid host's memory and blkio mounts: a node with worker and batch under it."""
    root = tmp_path / "cgroup"
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    for cg in ("node", "node/worker", "node/batch"):
        d = root / "memory" / cg
        write(d / "memory.usage_in_bytes", "104857600\n")
        write(d / "memory.limit_in_bytes", "9223372036854771712\n")
        write(d / "memory.failcnt", "3\n")
        write(d / "memory.oom_control", OOM_CONTROL_V1.format(kills=1))
        write(d / "memory.stat", "pgmajfault 5\ntotal_pgmajfault 7\n")
        write(d / "cgroup.procs", "")
    write(root / "blkio/blkio.reset_stats", "")
    write(root / "blkio/blkio.bfq.weight", "100\n")  # BFQ, with cgroup support
    for cg in ("worker", "batch"):
        write(root / "blkio" / cg / "blkio.bfq.weight", "100\n")
    (root / "unified").mkdir()
    write(root / "unified/cgroup.controllers", "\n")
    return root


def bfq_disks(tmp_path: Path) -> str:
    """A fake sysfs whose disks BFQ schedules, under the mounts of <tmp_path>/proc; its path."""
    fake_procfs(tmp_path)
    return str(fake_sysfs(tmp_path, vda="mq-deadline [bfq] none", nvme="[bfq] none"))


def fake_v2(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup2"
    write(root / "cgroup.controllers", "cpu io memory pids\n")
    for cg in ("system.slice", "system.slice/worker.service", "batch.slice"):
        d = root / cg
        write(d / "memory.current", "104857600\n")
        write(d / "memory.min", "0\n")
        write(d / "memory.high", "max\n")
        write(d / "memory.events", "low 0\nhigh 2\nmax 1\noom 1\noom_kill 1\noom_group_kill 0\n")
        write(d / "memory.stat", "anon 1\npgmajfault 9\n")
        write(d / "io.weight", "default 100\n")
    write(root / "system.slice/memory.min", "max\n")  # an operator's own protection of the slice
    return root


# ---- the hierarchies ------------------------------------------------------------------------


def test_v1_memory_knobs_found_and_read(tmp_path):
    root = fake_v1(tmp_path)
    h = MemoryHierarchy.find(str(root))
    assert (h.version, h.mount) == (1, str(root / "memory"))
    assert h.usage("/node/batch") == 104857600
    assert h.events("/node/batch") == {"max": 3, "oom_kill": 1}
    assert h.major_faults("/node/batch") == 7  # hierarchical
    assert h.limit_file("/node") == str(root / "memory/node/memory.limit_in_bytes")
    writes = h.squeeze_writes("/node/batch", 1000)
    assert writes == [
        (str(root / "memory/node/batch/memory.oom_control"), "1", "oom_kill_disable"),  # no kill first
        (str(root / "memory/node/batch/memory.limit_in_bytes"), str(PAGE), None),  # rounded up to a page
    ]
    with pytest.raises(CgroupError, match="v1 has no memory.min"):
        h.protect_writes({"/node/worker": 1 << 20})


def test_v2_memory_knobs_and_protection_up_the_tree(tmp_path):
    root = fake_v2(tmp_path)
    h = MemoryHierarchy.find(str(root))
    assert h.version == 2 and h.usage("batch.slice") == 104857600
    assert h.events("batch.slice")["high"] == 2 and h.major_faults("batch.slice") == 9
    assert h.squeeze_writes("batch.slice", 2 * PAGE) == [(str(root / "batch.slice/memory.high"), str(2 * PAGE), None)]
    # the service and each ancestor below the root at least as much; the slice already has max
    assert h.protect_writes({"system.slice/worker.service": 5000}) == [
        (str(root / "system.slice/worker.service/memory.min"), "5000")
    ]
    (root / "system.slice/memory.min").write_text("0\n")
    assert [p for p, _ in h.protect_writes({"system.slice/worker.service": 5000})] == [
        str(root / "system.slice/worker.service/memory.min"),
        str(root / "system.slice/memory.min"),
    ]
    # two workers side by side: their parent protects what both use (one's would leave both short)
    for cg in ("system.slice/worker-a.service", "system.slice/worker-b.service"):
        write(root / cg / "memory.min", "0\n")
    assert h.protect_writes({"system.slice/worker-a.service": 3000, "/system.slice/worker-b.service": 2000}) == [
        (str(root / "system.slice/worker-a.service/memory.min"), "3000"),
        (str(root / "system.slice/worker-b.service/memory.min"), "2000"),
        (str(root / "system.slice/memory.min"), "5000"),
    ]


def test_no_memory_controller_is_named(tmp_path):
    (tmp_path / "unified").mkdir()
    with pytest.raises(CgroupError, match="no cgroup memory controller.*v2 mount there has no memory"):
        MemoryHierarchy.find(str(tmp_path))


def test_io_weights_per_version(tmp_path):
    v1 = IoHierarchy.find(str(fake_v1(tmp_path)))
    assert v1.version == 1
    assert v1.weight_writes("/batch", 1) == [(f"{v1.mount}/batch/blkio.bfq.weight", "1")]
    assert v1.weight_writes("/worker", 10000)[0][1] == "1000"  # BFQ's range ends at 1000
    cfq = Path(v1.mount) / "old"
    write(cfq / "blkio.weight", "500\n")
    assert v1.weight_writes("/old", 100) == [(str(cfq / "blkio.weight"), "500")]  # systemd's conversion
    write(Path(v1.mount) / "none" / "tasks", "")
    with pytest.raises(CgroupError, match="no proportional io policy"):
        v1.weight_writes("/none", 100)
    with pytest.raises(CgroupError, match="does not exist"):
        v1.weight_writes("/gone", 100)
    v2 = IoHierarchy.find(str(fake_v2(tmp_path)))
    assert v2.weight_writes("batch.slice", 5) == [(f"{v2.mount}/batch.slice/io.weight", "default 5")]
    with pytest.raises(ValueError, match="1..10000"):
        v2.weight_writes("batch.slice", 0)


def test_keyed_lines_and_psi_file_of_a_process(tmp_path):
    assert keyed("low 0\nhigh 2\nbogus\nx y\n") == {"low": 0, "high": 2}
    root = fake_v2(tmp_path)
    write(root / "system.slice/worker.service/memory.pressure", "some total=0\nfull total=0\n")
    proc = tmp_path / "proc"
    write(proc / "7/cgroup", "0::/system.slice/worker.service\n")
    write(proc / "8/cgroup", "4:memory:/x\n0::/\n")
    assert psi_file(str(root), 7, procfs=str(proc)) == str(root / "system.slice/worker.service/memory.pressure")
    assert psi_file(str(root), 8, procfs=str(proc)) is None  # in the v2 root: the node's pressure
    hybrid = fake_v1(tmp_path)
    write(hybrid / "unified/w/memory.pressure", "some total=0\n")
    write(proc / "9/cgroup", "4:memory:/node/worker\n0::/w\n")
    assert psi_file(str(hybrid), 9, procfs=str(proc)) == str(hybrid / "unified/w/memory.pressure")


# ---- the journal's keyed and per-process knobs ---------------------------------------------


def test_a_keyed_knob_is_one_line_of_its_file(tmp_path):
    """v1's memory.oom_control takes "1" and shows "oom_kill_disable 1" among counters; the whole
    round trip through the kernel is in tests/agent/test_memory_pressure.py (a plain file cannot do it)."""
    f = tmp_path / "memory.oom_control"
    f.write_text("oom_kill_disable 1\nunder_oom 1\noom_kill 4\n")
    assert read_knob(str(f), "oom_kill_disable") == "1" and read_knob(str(f), "oom_kill") == "4"
    with pytest.raises(KnobError, match="no 'nothing' line"):
        read_knob(str(f), "nothing")


def test_a_knob_of_an_exited_process_is_nothing_to_restore(tmp_path):
    adj = tmp_path / "4242" / "oom_score_adj"
    write(adj, "0\n")
    state = tmp_path / "s.json"
    KnobJournal(str(state)).set(str(adj), "1000", vanishes=True)
    adj.unlink()
    adj.parent.rmdir()  # the process exited
    assert KnobJournal(str(state)).restore_leftovers() == []
    other = tmp_path / "cpu.shares"  # a file that is not a process's is still reported when gone
    other.write_text("1024\n")
    journal = KnobJournal(str(state))
    journal.set(str(other), "2")
    other.unlink()
    assert "cannot read" in journal.undo_all()[0]


# ---- the levers on fake trees ---------------------------------------------------------------


def test_squeeze_holds_each_best_effort_cgroup_at_its_usage_and_release_restores(tmp_path):
    """On v2, memory.high at the usage (v1's limit with OOM killing off: tests/agent/test_memory_pressure.py)."""
    root = fake_v2(tmp_path)
    cfg = LeversConfig(cgroup_root=str(root), best_effort_cgroups=["batch.slice"])  # memory's default too
    journal = KnobJournal(str(tmp_path / "s.json"))
    squeeze = MemorySqueeze(cfg, KnobWrites(journal))
    detail = squeeze.engage()
    held = detail["held_at_bytes"]["batch.slice"]
    assert held > 104857600 and detail["cgroup_version"] == 2
    assert read(root / "batch.slice/memory.high") == str(-(-held // PAGE) * PAGE)
    assert squeeze.release() == [] and read(root / "batch.slice/memory.high") == "max"
    assert journal.entries == {}
    nothing = MemorySqueeze(LeversConfig(cgroup_root=str(root)), KnobWrites(journal))
    with pytest.raises(CgroupError, match="no best-effort cgroups"):
        nothing.engage()


def test_protect_sets_memory_min_on_v2_and_leaves_v1_to_the_lock(tmp_path):
    v2 = fake_v2(tmp_path)
    proc = tmp_path / "proc"
    write(proc / "7/cgroup", "0::/system.slice/worker.service\n")
    journal = KnobJournal(str(tmp_path / "s.json"))
    worker = [WorkerCgroup("default", "auto", lambda: 7)]
    protect = MemoryProtect(LeversConfig(cgroup_root=str(v2)), KnobWrites(journal), worker, str(proc))
    assert protect.engage() == {
        "lock_memory": True,
        "cgroup_version": 2,
        "worker_cgroups": {"default": "/system.slice/worker.service"},
        "unresolved": {},
        "memory_min": {"/system.slice/worker.service": 104857600},
    }
    assert read(v2 / "system.slice/worker.service/memory.min") == "104857600"
    assert protect.release() == [] and read(v2 / "system.slice/worker.service/memory.min") == "0"
    v1 = fake_v1(tmp_path)
    write(proc / "8/cgroup", "4:memory:/node/worker\n")
    worker = [WorkerCgroup("default", "auto", lambda: 8)]
    on_v1 = MemoryProtect(LeversConfig(cgroup_root=str(v1)), KnobWrites(journal), worker, str(proc))
    detail = on_v1.engage()  # engaged all the same: the worker's lock rides on its throttle
    assert detail["lock_memory"] and "v1 has no memory.min" in detail["memory_min"] and journal.entries == {}


def test_io_weight_and_memory_protect_act_on_every_worker_and_find_a_late_one(tmp_path, monkeypatch):
    """Several workers: each one's io weight raised and memory protected; one that has not
    answered yet (no pid) leaves the others' done, and is done once it answers, while the lever
    stays engaged (the node's Levers look again, as for cpu_share)."""
    import agent.levers.cgroup as cgroup_lever

    v1, v2 = fake_v1(tmp_path), fake_v2(tmp_path)
    write(v1 / "blkio/worker-b/blkio.bfq.weight", "100\n")
    write(v2 / "system.slice/worker-b.service/memory.current", "52428800\n")
    write(v2 / "system.slice/worker-b.service/memory.min", "0\n")
    write(v2 / "system.slice/memory.min", "0\n")
    proc = tmp_path / "proc"
    write(proc / "7/cgroup", "7:blkio:/worker\n0::/system.slice/worker.service\n")
    write(proc / "9/cgroup", "7:blkio:/worker-b\n0::/system.slice/worker-b.service\n")
    pids: dict[str, int | None] = {"a": 7, "b": None}
    workers = [WorkerCgroup(n, "auto", lambda n=n: pids[n]) for n in ("a", "b")]
    io_cfg = LeversConfig(cgroup_root=str(v1), oom_guard=False)
    io = Levers(io_cfg, str(tmp_path / "io.json"), workers, str(proc), sysfs=bfq_disks(tmp_path))
    memory = Levers(LeversConfig(cgroup_root=str(v2), oom_guard=False), str(tmp_path / "m.json"), workers, str(proc))
    io.reconcile({"io_weight": "x"}, {}, "recovery")
    memory.reconcile({"memory_protect": "x"}, {}, "recovery")
    st, mst = io.status()["io_weight"], memory.status()["memory_protect"]
    assert st["engaged"] and st["worker_cgroups"] == {"a": "/worker"} and "pid is not known" in st["unresolved"]["b"]
    assert [read(v1 / f"blkio/{cg}/blkio.bfq.weight") for cg in ("worker", "worker-b")] == ["1000", "100"]
    assert mst["engaged"] and mst["memory_min"] == {"/system.slice/worker.service": 104857600}
    assert [read(v2 / f"system.slice/{cg}memory.min") for cg in ("", "worker.service/", "worker-b.service/")] == [
        "104857600",
        "104857600",
        "0",
    ]
    pids["b"] = 9  # b answers; a second later the engaged levers find its cgroups
    monkeypatch.setattr(cgroup_lever, "RESOLVE_RETRY_S", 0.0)
    io.reconcile({"io_weight": "x"}, {}, "recovery")
    memory.reconcile({"memory_protect": "x"}, {}, "recovery")
    assert io.status()["io_weight"]["worker_cgroups"] == {"a": "/worker", "b": "/worker-b"}
    assert read(v1 / "blkio/worker-b/blkio.bfq.weight") == "1000"
    assert [read(v2 / f"system.slice/{cg}memory.min") for cg in ("", "worker.service/", "worker-b.service/")] == [
        "157286400",  # the slice: what both use
        "104857600",
        "52428800",
    ]
    io.reconcile({}, {}, "recovery")  # released: everything back
    memory.reconcile({}, {}, "recovery")
    assert [read(v1 / f"blkio/{cg}/blkio.bfq.weight") for cg in ("worker", "worker-b", "batch")] == ["100"] * 3
    assert [read(v2 / f"system.slice/{cg}memory.min") for cg in ("", "worker.service/", "worker-b.service/")] == [
        "0"
    ] * 3


def test_io_weight_lever_on_v1(tmp_path):
    root = fake_v1(tmp_path)
    proc = tmp_path / "proc"
    write(proc / "7/cgroup", "7:blkio:/worker\n")
    cfg = LeversConfig(cgroup_root=str(root), best_effort_cgroups=["/batch"])
    worker = [WorkerCgroup("default", "auto", lambda: 7)]
    writes = KnobWrites(KnobJournal(str(tmp_path / "s.json")))
    lever = IoWeight(cfg, writes, worker, str(proc), sysfs=bfq_disks(tmp_path))
    assert lever.engage()["worker_cgroups"] == {"default": "/worker"}
    assert [read(root / f"blkio/{cg}/blkio.bfq.weight") for cg in ("worker", "batch")] == ["1000", "1"]
    assert lever.release() == []
    assert [read(root / f"blkio/{cg}/blkio.bfq.weight") for cg in ("worker", "batch")] == ["100", "100"]


def fake_process(proc: Path, pid: int, adj: int) -> Path:
    write(proc / str(pid) / "oom_score_adj", f"{adj}\n")
    return proc / str(pid) / "oom_score_adj"


def test_oom_guard_lowers_the_worker_raises_best_effort_and_forgets_exited_processes(tmp_path):
    root = fake_v1(tmp_path)
    proc = tmp_path / "proc"
    worker = [fake_process(proc, pid, 0) for pid in (10, 11)]
    agent = fake_process(proc, 12, 0)
    batch = [fake_process(proc, 20, 0), fake_process(proc, 21, 1000)]
    protected = fake_process(proc, 30, -1000)  # a worker set lower by its unit: left as it is
    write(root / "memory/node/batch/cgroup.procs", "20\n")
    write(root / "memory/node/batch/job/cgroup.procs", "21\n")  # a child cgroup's processes count too
    cfg = LeversConfig(cgroup_root=str(root), memory_best_effort_cgroups=["/node/batch"])
    journal = KnobJournal(str(tmp_path / "s.json"))
    pids = [10, 11, 30]
    guard = OomGuard(cfg, KnobWrites(journal), lambda: pids, str(proc), own=str(agent), can_lower=True)
    guard.refresh(0.0)
    assert [read(p) for p in (*worker, agent)] == ["-900"] * 3
    assert [read(p) for p in batch] == ["1000", "1000"] and read(protected) == "-1000"
    assert guard.status()["processes"] == {"worker": 3, "best_effort": 2} and guard.error is None
    assert set(journal.entries) == {str(p) for p in (*worker, agent, batch[0])}
    assert not guard.due(0.5) and guard.due(1.0)
    for f in worker:  # the worker restarted: its old processes are gone
        f.unlink()
        f.parent.rmdir()
    pids[:] = [13]
    new = fake_process(proc, 13, 0)
    guard.refresh(1.0)
    assert read(new) == "-900" and str(worker[0]) not in journal.entries
    assert guard.release() == []
    assert [read(p) for p in (new, agent, batch[0])] == ["0", "0", "0"] and journal.entries == {}


def test_oom_guard_reports_what_it_cannot_do(tmp_path):
    proc = tmp_path / "proc"
    (proc / "10").mkdir(parents=True)  # a process whose oom_score_adj cannot be read
    cfg = LeversConfig(cgroup_root=str(tmp_path / "none"))
    guard = OomGuard(
        cfg,
        KnobWrites(KnobJournal(str(tmp_path / "s.json"))),
        lambda: [10],
        str(proc),
        own=str(proc / "10/oom_score_adj"),
        can_lower=True,
    )
    guard.refresh(0.0)
    assert "no cgroup memory controller" in guard.error and "cannot read" in guard.error


# ---- the watcher ----------------------------------------------------------------------------


def stat_line(pid: int, majflt: int) -> str:
    """A /proc/PID/stat line: majflt is field 12; a command name with spaces and parentheses."""
    return f"{pid} (py (x) y) S 1 {pid} {pid} 0 -1 4194304 100 0 {majflt} 0 10 5 0 0 20 0 9 0 500 1000 200\n"


def test_major_faults_field():
    assert process_major_faults(process_stat_fields(stat_line(7, 1234))) == 1234


def test_memory_watcher_rates_events_and_a_restarted_worker(tmp_path):
    root = fake_v1(tmp_path)
    proc = tmp_path / "proc"
    write(proc / "10/stat", stat_line(10, 100))
    write(proc / "10/cgroup", "4:memory:/node/worker\n0::/\n")
    pids = [10]
    w = MemoryWatcher(str(proc), lambda: pids, str(root), "auto", ["/node/batch"])
    assert w.sample(0.0) == {
        "worker_major_faults_per_s": None,
        "worker_psi_memory_some": None,
        "best_effort_memory_held": None,
    }
    write(proc / "10/stat", stat_line(10, 150))
    sig = w.sample(0.5)
    assert sig["worker_major_faults_per_s"] == pytest.approx(100.0) and sig["best_effort_memory_held"] == 0.0
    assert w.detail["cgroups"]["worker"] == {
        "cgroup": "/node/worker",
        "usage_bytes": 104857600,
        "events": {"max": 3, "oom_kill": 1},
    }
    assert w.detail["cgroups"]["/node/batch"]["events"]["oom_kill"] == 1
    batch = root / "memory/node/batch"
    (batch / "memory.failcnt").write_text("4\n")  # the squeezed job hit its limit again: held
    assert w.sample(0.75)["best_effort_memory_held"] == 1.0
    assert w.sample(0.9)["best_effort_memory_held"] == 0.0
    (batch / "memory.oom_control").write_text("oom_kill_disable 1\nunder_oom 1\noom_kill 1\n")  # it waits there
    assert w.sample(1.0)["best_effort_memory_held"] == 1.0
    pids[:] = [11]  # restarted: the new process counts from its first sample, the total goes on
    write(proc / "11/stat", stat_line(11, 900))
    write(proc / "11/cgroup", "4:memory:/node/worker\n")
    w.sample(1.5)
    assert w.major_faults_total == 50
    names = {f.name: f for f in w.families()}
    assert names["turbonode_worker_major_faults"].samples[0].value == 50
    kills = [s for s in names["turbonode_cgroup_memory_events"].samples if s.labels["event"] == "oom_kill"]
    assert {s.labels["cgroup"] for s in kills} == {"/node/worker", "/node/batch"}


def test_memory_watcher_without_memory_controller_keeps_the_fault_signal(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "10/stat", stat_line(10, 0))
    write(proc / "10/cgroup", "0::/\n")
    w = MemoryWatcher(str(proc), lambda: [10], str(tmp_path / "none"))
    w.sample(0.0)
    write(proc / "10/stat", stat_line(10, 10))
    assert w.sample(1.0)["worker_major_faults_per_s"] == pytest.approx(10.0)
    assert w.ok and "no cgroup memory controller" in w.detail["cgroup_error"]


def test_memory_watcher_reads_the_worker_cgroup_pressure_on_v2(tmp_path):
    root = fake_v2(tmp_path)
    psi = root / "system.slice/worker.service/memory.pressure"
    write(psi, "some avg10=0 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n")
    proc = tmp_path / "proc"
    write(proc / "7/stat", stat_line(7, 0))
    write(proc / "7/cgroup", "0::/system.slice/worker.service\n")
    w = MemoryWatcher(str(proc), lambda: [7], str(root))
    w.sample(0.0)
    psi.write_text("some avg10=0 avg60=0 avg300=0 total=250000\nfull avg10=0 avg60=0 avg300=0 total=0\n")
    assert w.sample(1.0)["worker_psi_memory_some"] == pytest.approx(0.25)
    assert w.detail["cgroups"]["worker"]["events"]["high"] == 2


def test_memory_watcher_reports_the_most_stalled_workers_cgroup_pressure(tmp_path):
    """Several workers, each its v2 cgroup: the signal is the most stalled one's (a later
    worker's stall counts as much as the first's), read once per cgroup; a pid gone is skipped."""
    root = fake_v2(tmp_path)
    proc = tmp_path / "proc"
    quiet = "some avg10=0 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n"
    for pid, cg in ((7, "worker-a.service"), (8, "worker-a.service"), (9, "worker-b.service")):
        write(root / "system.slice" / cg / "memory.pressure", quiet)
        write(proc / f"{pid}/stat", stat_line(pid, 0))
        write(proc / f"{pid}/cgroup", f"0::/system.slice/{cg}\n")
    w = MemoryWatcher(str(proc), lambda: [7, 8, 9, 11], str(root))
    w.sample(0.0)
    write(
        root / "system.slice/worker-a.service/memory.pressure",
        quiet.replace("some avg10=0 avg60=0 avg300=0 total=0", "some avg10=0 avg60=0 avg300=0 total=100000"),
    )
    write(
        root / "system.slice/worker-b.service/memory.pressure",
        quiet.replace("some avg10=0 avg60=0 avg300=0 total=0", "some avg10=0 avg60=0 avg300=0 total=400000"),
    )
    assert w.sample(1.0)["worker_psi_memory_some"] == pytest.approx(0.4)
    assert w.ok and len(w.detail["worker_psi_files"]) == 2
