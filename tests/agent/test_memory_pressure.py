"""Memory pressure for real, always bounded: every process that allocates runs in a memory cgroup
under a parent whose limit (a few hundred MiB) stands for a node's RAM, so reclaim and OOM happen
inside it and never to the machine. On this host's cgroup v1 (memory files, oom_score_adj):

- a job driven into its node's limit is held by the squeeze lever (its tasks wait at the limit,
  nothing is killed) and goes on growing once released, until the kernel kills it;
- the OOM killer picks the largest process, the worker, unless the OOM guard has set the
  oom_score_adj values: then it kills the job;
- what the levers changed is put back by the next agent after a kill -9;
- a running agent engages the squeeze when PSI memory rises (a procfs the test drives), shows it,
  releases it on recovery and at stop, and a new agent restores what a killed one left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import TypeVar

import pytest

from agent.levers.journal import KnobJournal, KnobWrites, read_knob
from agent.levers.memory import MemorySqueeze, OomGuard
from bench.node import wait_for
from sandbox.node_memory import NodeMemory
from tests.agent.helpers import real_v1, start_agent, stop_agent
from tests.helpers import ROOT, FakeProc, MiniWorker, kill_9_once
from turbonode import caps
from turbonode.cgroups import Hierarchy
from turbonode.config import LeversConfig
from turbonode.memory_cgroups import OOM_CONTROL, OOM_KILL_DISABLE, MemoryHierarchy

H = TypeVar("H", bound=Hierarchy)
MIB = 1 << 20
NODE_MB = 256  # the node's RAM in these tests: all they may allocate
_mask = caps.effective()
# the guard lowers the worker's oom_score_adj only with CAP_SYS_RESOURCE (the development VM's root lacks it)
LOWERED = "-900" if _mask is None or _mask >> caps.CAP_SYS_RESOURCE & 1 else "0"


def real_memory() -> MemoryHierarchy:
    return real_v1(MemoryHierarchy, "test_memory_cgroups.py")


@pytest.fixture
def node():
    """A node memory cgroup limited to NODE_MB with `worker` and `batch` children; removed after,
    with whatever still runs in it killed."""
    h = real_memory()
    parent = f"/tn-test-{uuid.uuid4().hex[:8]}-node"
    made = []
    try:
        h.create(parent)
        made.append(parent)
        Path(h.limit_file(parent)).write_text(str(NODE_MB * MIB))
        for child in ("worker", "batch"):
            h.create(f"{parent}/{child}")
            made.append(f"{parent}/{child}")
        yield h, parent
    finally:
        for cg in reversed(made):
            for pid in h.procs(cg) if os.path.isdir(h.dir(cg)) else []:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            wait_for(lambda cg=cg: not h.procs(cg), 5)
            h.remove(cg)


def in_cgroup(h: MemoryHierarchy, cgroup: str, code: str) -> subprocess.Popen:
    """A Python process that moves itself into `cgroup` before it runs `code` (so that everything
    it allocates is charged there)."""
    argv = ["sh", "-c", f'echo $$ > {h.procs_file(cgroup)} && exec "$@"', "sh", sys.executable, "-c", code]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def grower(h: MemoryHierarchy, cgroup: str, mb_per_s: int = 40, seconds: float = 30) -> subprocess.Popen:
    code = f"from sandbox.pressure import main; main(['grow', '--mb-per-s', '{mb_per_s}', '--seconds', '{seconds}'])"
    return in_cgroup(h, cgroup, code)


def holder(h: MemoryHierarchy, cgroup: str, mb: int) -> subprocess.Popen:
    """The worker's stand-in: `mb` MiB touched, then asleep; says 'ready'."""
    code = (
        f"import time; from sandbox.pressure import touched; m = touched({mb}); print('ready', flush=True); "
        "time.sleep(60)"
    )
    proc = in_cgroup(h, cgroup, code)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def oom_control(h: MemoryHierarchy, cgroup: str, key: str) -> str:
    return read_knob(h.file(cgroup, OOM_CONTROL), key)


def test_the_squeeze_holds_a_growing_job_without_killing_it_and_the_kernel_kills_it_once_released(node, tmp_path):
    h, parent = node
    batch = f"{parent}/batch"
    cfg = LeversConfig(memory_best_effort_cgroups=[batch])
    job = grower(h, batch)
    try:
        assert wait_for(lambda: h.usage(batch) > 64 * MIB, 10)
        squeeze = MemorySqueeze(cfg, KnobWrites(KnobJournal(str(tmp_path / "levers.json"))))
        held = squeeze.engage()["held_at_bytes"][batch]
        limit = Path(h.limit_file(batch)).read_text().strip()
        assert int(limit) >= held and oom_control(h, batch, OOM_KILL_DISABLE) == "1"
        # the job hits its new limit and waits there: nothing is killed, it stops growing
        assert wait_for(lambda: oom_control(h, batch, "under_oom") == "1", 10)
        time.sleep(1.0)
        assert job.poll() is None and h.usage(batch) <= int(limit)
        assert h.events(batch)["max"] > 0 and h.events(batch)["oom_kill"] == 0
        assert squeeze.release() == []
        assert Path(h.limit_file(batch)).read_text().strip() == "9223372036854771712"
        assert oom_control(h, batch, OOM_KILL_DISABLE) == "0"
        # released, it grows on into the node's limit, and the kernel kills it there
        assert wait_for(lambda: job.poll() is not None, 20)
        assert job.returncode == -signal.SIGKILL
        assert h.events(batch)["oom_kill"] >= 1 and h.usage(parent) < NODE_MB * MIB // 2  # counted where it died
    finally:
        job.kill()
        job.wait()


def test_the_oom_killer_takes_the_worker_unless_the_guard_has_set_oom_score_adj(node, tmp_path):
    h, parent = node
    worker_cg, batch = f"{parent}/worker", f"{parent}/batch"
    # plain: the worker (150 MiB) is larger than the job when the node runs out (after ~2 s at
    # 40 MiB/s): the kernel kills the worker
    worker = holder(h, worker_cg, 150)
    job = grower(h, batch)
    try:
        assert wait_for(lambda: worker.poll() is not None or job.poll() is not None, 15)
        assert worker.poll() == -signal.SIGKILL and job.poll() is None
    finally:
        for p in (worker, job):
            p.kill()
            p.wait()
    # guarded: the same worker and job, the worker at -900 and the job at +1000: the job dies
    worker = holder(h, worker_cg, 150)
    cfg = LeversConfig(memory_best_effort_cgroups=[batch])
    guard = OomGuard(cfg, KnobWrites(KnobJournal(str(tmp_path / "levers.json"))), lambda: [worker.pid])
    job = grower(h, batch)
    try:
        assert wait_for(lambda: h.procs(batch), 5)
        guard.refresh(time.monotonic())
        assert guard.error is None, guard.error
        # lowering needs CAP_SYS_RESOURCE (the development VM's root lacks it): raising the job alone
        # is enough for the kernel's choice
        lowered = "-900" if guard.can_lower else "0"
        assert Path(f"/proc/{worker.pid}/oom_score_adj").read_text().strip() == lowered
        assert Path(f"/proc/{job.pid}/oom_score_adj").read_text().strip() == "1000"
        assert wait_for(lambda: job.poll() is not None, 15)
        assert job.returncode == -signal.SIGKILL and worker.poll() is None
        assert guard.release() == []
        assert Path(f"/proc/{worker.pid}/oom_score_adj").read_text().strip() == "0"
        assert Path(f"/proc/{os.getpid()}/oom_score_adj").read_text().strip() == "0"  # ours, as it was
    finally:
        for p in (worker, job):
            p.kill()
            p.wait()


def test_what_the_levers_changed_is_restored_after_kill_9(node, tmp_path):
    h, parent = node
    batch = f"{parent}/batch"
    worker, job = holder(h, f"{parent}/worker", 8), holder(h, batch, 8)
    state = tmp_path / "levers.json"
    limit = Path(h.limit_file(batch))
    before = limit.read_text().strip()
    agent = textwrap.dedent(f"""
        import time
        from agent.levers import Levers
        from agent.levers.cgroup import WorkerCgroup
        from turbonode.config import LeversConfig
        cfg = LeversConfig(memory_best_effort_cgroups=[{batch!r}])
        workers = [WorkerCgroup("default", "auto", lambda: {worker.pid})]
        levers = Levers(cfg, {str(state)!r}, workers, worker_pids=lambda: [{worker.pid}])
        levers.reconcile({{"memory_squeeze": "psi_memory_some=0.3 > 0.1"}}, {{}}, "recovery")
        assert levers.status()["memory_squeeze"]["engaged"], levers.status()
        print("engaged", flush=True)
        time.sleep(60)
    """)
    kill_9_once(agent)
    try:
        assert limit.read_text().strip() != before and oom_control(h, batch, OOM_KILL_DISABLE) == "1"
        assert Path(f"/proc/{job.pid}/oom_score_adj").read_text().strip() == "1000"
        assert KnobJournal(str(state)).restore_leftovers() == []  # what the next agent does first
        assert limit.read_text().strip() == before and oom_control(h, batch, OOM_KILL_DISABLE) == "0"
        assert Path(f"/proc/{job.pid}/oom_score_adj").read_text().strip() == "0"
        assert not state.exists()  # the dead agent's own entry went with its process
    finally:
        for p in (worker, job):
            p.kill()
            p.wait()


class PidsWorker(MiniWorker):
    """The mini worker whose status names its processes, as the real one's does."""

    def __init__(self, pids: list[int]):
        super().__init__()
        self.pids = pids

    def status(self, since_gc_seq=None):
        return {**super().status(since_gc_seq), "pids": self.pids}


def drive_memory_pressure(fake: FakeProc, stall: list[float]) -> None:
    """Make the fake procfs's pressure/memory stall `stall[0]` of each second from now on."""
    path = fake.root / "pressure" / "memory"
    total = [0.0]

    def tick():
        while not fake._stop.wait(0.02):
            total[0] += stall[0] * 0.02 * 1e6
            line = f"avg10=0.00 avg60=0.00 avg300=0.00 total={int(total[0])}"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"some {line}\nfull {line}\n")
            tmp.rename(path)

    threading.Thread(target=tick, daemon=True).start()


@pytest.mark.slow
def test_agent_squeezes_on_memory_pressure_guards_the_worker_and_restores_after_kill_9(node, tmp_path):
    h, parent = node
    batch = f"{parent}/batch"
    worker = holder(h, f"{parent}/worker", 8)
    job = holder(h, batch, 8)
    mini = PidsWorker([worker.pid])
    srv = mini.serve(str(tmp_path / "worker.sock"))
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    fake = FakeProc(proc_root)
    for pid in (worker.pid, job.pid):  # the agent's procfs shows the real processes it guards
        (proc_root / str(pid)).symlink_to(f"/proc/{pid}")
    stall = [0.0]
    drive_memory_pressure(fake, stall)
    limit, adj = Path(h.limit_file(batch)), [Path(f"/proc/{p}/oom_score_adj") for p in (worker.pid, job.pid)]
    toml = (
        f'procfs = "{proc_root}"\n[policy]\nexit_s = 1.0\nmin_change_interval = 0.5\n'
        'disabled = ["netrx_cpu_share", "netrx_latency_p99_s", "cpu_load"]\n[node]\nname = "tn-mem"\n'
        "[policy.rules.psi_memory_some]\nexit_s = 1.0\n"  # its own 30 s, shortened for the test
        f'[levers]\nmemory_best_effort_cgroups = ["{batch}"]\n'
    )

    def levers():
        return agent.call("status")["actions"]["levers"]

    proc, agent, port = start_agent(tmp_path, tmp_path / "worker.sock", toml)
    try:
        assert wait_for(lambda: [a.read_text().strip() for a in adj] == [LOWERED, "1000"], 5), levers()
        # the worker's pids come with its status (every second), the guard looks every second
        assert wait_for(lambda: levers()["oom_guard"]["processes"] == {"worker": 1, "best_effort": 1}, 5), levers()
        stall[0] = 0.3
        assert wait_for(lambda: levers()["memory_squeeze"]["engaged"], 5), levers()
        assert oom_control(h, batch, OOM_KILL_DISABLE) == "1" and limit.read_text().strip() != "9223372036854771712"
        assert levers()["memory_squeeze"]["reason"].startswith("psi_memory_some=0.")
        # protected by the worker's lock on v1 (memory.min is v2's): it rides on the throttle
        assert (
            levers()["memory_protect"]["engaged"] and "v1 has no memory.min" in levers()["memory_protect"]["memory_min"]
        )
        assert wait_for(lambda: (mini.throttle_state or {}).get("lock_memory") is True, 3), mini.throttle_state
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'turbonode_lever_engaged{lever="memory_squeeze",node="tn-mem",worker=""} 1.0' in text
        assert f'turbonode_cgroup_memory_events_total{{cgroup="{batch}",event="oom_kill",node="tn-mem"}}' in text
        stall[0] = 0.0  # recovery: released
        assert wait_for(lambda: not levers()["memory_squeeze"]["engaged"], 10), levers()
        assert limit.read_text().strip() == "9223372036854771712" and oom_control(h, batch, OOM_KILL_DISABLE) == "0"
        assert wait_for(lambda: not (mini.throttle_state or {}).get("lock_memory"), 3), mini.throttle_state
        stall[0] = 0.3  # engaged again, then the agent is killed
        assert wait_for(lambda: levers()["memory_squeeze"]["engaged"], 5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        assert oom_control(h, batch, OOM_KILL_DISABLE) == "1" and adj[1].read_text().strip() == "1000"
        stall[0] = 0.0
        proc, agent, port = start_agent(tmp_path, tmp_path / "worker.sock", toml)  # restores, then guards again
        assert oom_control(h, batch, OOM_KILL_DISABLE) == "0" and limit.read_text().strip() == "9223372036854771712"
        assert levers()["restore_problems"] == []
        rc, out = stop_agent(proc)  # SIGTERM: the guard is released too
        assert rc == 0, out
        assert [a.read_text().strip() for a in adj] == ["0", "0"]
    finally:
        if proc.poll() is None:
            stop_agent(proc)
        fake.close()
        srv.close()
        for p in (worker, job):
            p.kill()
            p.wait()


def test_the_sandbox_node_memory_cgroups_are_made_limited_and_removed():
    h = real_memory()
    name = f"tn-test-{uuid.uuid4().hex[:8]}"
    node = NodeMemory(name, NODE_MB, {"worker": f"/{name}-worker", "batch": f"/{name}-batch"}, log=lambda _: None)
    try:
        node.make()
        assert Path(h.limit_file(f"/{name}-node")).read_text().strip() == str(NODE_MB * MIB)
        assert node.procs_files("batch")[0] == h.procs_file(f"/{name}-node/batch")
        assert node.levers_toml() == f'memory_best_effort_cgroups = ["/{name}-node/batch"]\n'
        assert node.oom_kills() == {"worker": 0, "batch": 0, "agent": 0}
    finally:
        node.remove()
    assert not os.path.exists(h.dir(f"/{name}-node"))
    if node.io is not None:
        assert not os.path.exists(node.io.dir(f"/{name}-batch"))


def test_the_sandbox_node_io_cgroups_nested_like_a_fleet_node_are_made_with_their_parents():
    real_memory()
    name = f"tn-test-{uuid.uuid4().hex[:8]}"
    roles = {"worker": f"/{name}-top/worker", "batch": f"/{name}-top/batch"}  # sandbox/fleet.py's layout
    node = NodeMemory(name, 0, roles, log=pytest.fail)  # nothing may be left out
    if node.io is None:
        pytest.skip("no blkio/io controller here")
    try:
        node.make()
        assert node.io is not None and node.procs_files("batch") == [node.io.procs_file(roles["batch"])]
        assert os.path.isdir(node.io.dir(roles["worker"]))
    finally:
        node.remove()
    assert not os.path.exists(node.io.dir(f"/{name}-top"))


def test_the_pressure_programs_stay_in_their_bounds_and_delete_their_files(node, tmp_path):
    h, parent = node
    batch = f"{parent}/batch"

    def run(*args: str) -> subprocess.CompletedProcess:
        code = f"from sandbox.pressure import main; main({list(args)!r})"
        argv = ["sh", "-c", f'echo $$ > {h.procs_file(batch)} && exec "$@"', "sh", sys.executable, "-c", code]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)

    # a file twice the node's RAM streams through the page cache: charged to the job, reclaimed
    # within the node's limit, never read from disk (sparse), deleted after
    done = run("stream", "--dir", str(tmp_path), "--size-mb", str(2 * NODE_MB), "--seconds", "3")
    assert done.returncode == 0 and "stream pass" in done.stdout, done.stderr
    assert h.events(batch)["oom_kill"] == 0 and list(tmp_path.iterdir()) == []
    done = run("write", "--dir", str(tmp_path), "--size-mb", "8", "--seconds", "1")
    assert done.returncode == 0 and list(tmp_path.iterdir()) == [], done.stderr
    refused = run("write", "--dir", "/dev/shm", "--size-mb", "8", "--seconds", "1")
    assert "is a tmpfs" in refused.stderr
