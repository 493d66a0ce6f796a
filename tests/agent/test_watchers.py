"""Watchers on fake /proc trees (parsing edge cases) and on the real /proc of this machine."""

import errno
import os
import select
import shutil
import subprocess
import sys
import time

import pytest

from agent.watchers.cpu import CpuWatcher, parse_stat, process_cpu_ticks
from agent.watchers.gpu import GpuWatcher
from agent.watchers.memory import PLACEMENT_RECHECK_S, MemoryWatcher
from agent.watchers.procfile import WorkerProcesses, process_stat_fields, read_text
from agent.watchers.psi import PsiTriggers, PsiWatcher, _refusal, parse_pressure
from agent.watchers.softirq import SoftirqWatcher, quantile
from agent.watchers.softirqs_proc import parse_softirqs
from agent.watchers.softnet import SoftnetWatcher, parse_softnet
from tests.agent.helpers import scrape
from turbonode import caps


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---- /proc/stat -------------------------------------------------------------------------

STAT = "cpu  {u} 0 {s} {i} 0 0 {si} {st} 0 0\ncpu0 {u} 0 {s} {i} 0 0 {si} {st} 0 0\nintr 1 2 3\nctxt 5\n"


def test_cpu_busy_share_includes_softirq_and_steal(tmp_path):
    write(tmp_path, "stat", STAT.format(u=100, s=50, i=800, si=10, st=5))
    w = CpuWatcher(str(tmp_path))
    assert w.sample(0.0) == {"cpu_load": None}  # first sample: no rate yet
    write(tmp_path, "stat", STAT.format(u=150, s=75, i=820, si=30, st=25))
    sig = w.sample(1.0)
    assert sig["cpu_load"] == pytest.approx(1 - 20 / 135)  # deltas: 50+25+20 idle+20 softirq+20 steal
    assert sig["cpu_softirq"] == pytest.approx(20 / 135) and sig["cpu_steal"] == pytest.approx(20 / 135)
    assert "cpu0" in w.detail["per_cpu"]


def test_cpu_old_kernel_without_steal_column(tmp_path):
    write(tmp_path, "stat", "cpu  10 0 10 80\n")
    w = CpuWatcher(str(tmp_path))
    w.sample(0)
    write(tmp_path, "stat", "cpu  60 0 10 110\n")
    assert w.sample(1)["cpu_load"] == pytest.approx(50 / 80)
    assert "steal" not in parse_stat("cpu 1 2 3 4\n")["cpu"]


def pid_stat(pid: int, comm: str, utime: int, stime: int) -> str:
    """A /proc/PID/stat line: utime and stime are fields 14 and 15."""
    return f"{pid} ({comm}) R 1 {pid} {pid} 0 -1 4194304 100 0 0 0 {utime} {stime} 0 0 20 0 9 0 500 1000 200\n"


def test_cpu_load_is_what_others_than_the_workers_take(tmp_path):
    """Busy time less the worker processes' own: a busy worker on an idle node is no load."""
    pids = [41, 42]
    write(tmp_path, "stat", STAT.format(u=100, s=50, i=800, si=10, st=5))
    write(tmp_path, "41/stat", pid_stat(41, "turboctl worker", 10, 5))
    write(tmp_path, "42/stat", pid_stat(42, "python3 (engine) x", 30, 0))  # spaces and parens in comm
    w = CpuWatcher(str(tmp_path), worker_pids=lambda: pids)
    w.sample(0.0)
    # 135 ticks passed on the CPUs, 115 of them busy; the workers took 10 + 70 of them
    write(tmp_path, "stat", STAT.format(u=150, s=75, i=820, si=30, st=25))
    write(tmp_path, "41/stat", pid_stat(41, "turboctl worker", 15, 10))
    write(tmp_path, "42/stat", pid_stat(42, "python3 (engine) x", 100, 0))
    sig = w.sample(1.0)
    assert sig["cpu_load"] == pytest.approx((115 - 80) / 135)
    assert w.detail["total"]["workers"] == pytest.approx(80 / 135)
    assert w.detail["total"]["busy"] == pytest.approx(115 / 135)
    # the engine restarted (pid 43, counted from its first sample), pid 42 is gone; a stat line
    # the worker cannot have written (a pid reused by nothing readable) is skipped
    pids[:] = [41, 43, 44]
    (tmp_path / "42" / "stat").unlink()
    write(tmp_path, "43/stat", pid_stat(43, "python3", 500, 0))
    write(tmp_path, "44/stat", "garbage\n")
    write(tmp_path, "stat", STAT.format(u=250, s=75, i=820, si=30, st=25))
    write(tmp_path, "41/stat", pid_stat(41, "turboctl worker", 40, 10))
    assert w.sample(2.0)["cpu_load"] == pytest.approx((100 - 25) / 100)
    # the workers' ticks, read a moment after /proc/stat, never make others' share negative
    write(tmp_path, "stat", STAT.format(u=260, s=75, i=830, si=30, st=25))
    write(tmp_path, "41/stat", pid_stat(41, "turboctl worker", 60, 10))
    write(tmp_path, "43/stat", pid_stat(43, "python3", 500, 0))
    assert w.sample(3.0)["cpu_load"] == 0


def psi_cpu(some_total_us: int) -> str:
    some = f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some_total_us}\n"
    return some + "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def test_cpu_load_stays_up_while_a_lever_holds_a_hog_back(tmp_path):
    """With the worker favoured a hog takes little CPU time, but its tasks wait: PSI cpu some
    keeps the contention (and so the lever) up. Without PSI the busy share alone counts."""
    write(tmp_path, "stat", STAT.format(u=100, s=0, i=0, si=0, st=0))
    write(tmp_path, "7/stat", pid_stat(7, "worker", 0, 0))
    write(tmp_path, "pressure/cpu", psi_cpu(0))
    w = CpuWatcher(str(tmp_path), worker_pids=lambda: [7])
    w.sample(0.0)
    # 1 s: 200 ticks, all busy, 180 of them the worker's; some task waited 0.8 s of it
    write(tmp_path, "stat", STAT.format(u=300, s=0, i=0, si=0, st=0))
    write(tmp_path, "7/stat", pid_stat(7, "worker", 180, 0))
    write(tmp_path, "pressure/cpu", psi_cpu(800_000))
    assert w.sample(1.0)["cpu_load"] == pytest.approx(0.8)
    assert w.detail["total"]["psi_some"] == pytest.approx(0.8) and w.detail["total"]["workers"] == pytest.approx(0.9)
    # nobody waits: the others' share (0.1) is what is left
    write(tmp_path, "stat", STAT.format(u=500, s=0, i=0, si=0, st=0))
    write(tmp_path, "7/stat", pid_stat(7, "worker", 360, 0))
    assert w.sample(2.0)["cpu_load"] == pytest.approx(0.1)


def schedstat(waited_ns: int) -> str:
    """A /proc/PID/task/TID/schedstat line: run time, run delay, timeslices."""
    return f"123456 {waited_ns} 42\n"


def test_cpu_load_leaves_out_the_workers_own_waits(tmp_path):
    """The workers' threads waiting behind each other raise PSI cpu some but are no contention:
    what they waited (per thread, summed, per busy CPU) comes off it. A thread seen first counts
    from its next sample; one that exited is forgotten."""
    write(tmp_path, "stat", STAT.format(u=100, s=0, i=0, si=0, st=0) + "cpu1 0 0 0 0 0 0 0 0\n")
    write(tmp_path, "7/stat", pid_stat(7, "worker", 0, 0))
    for tid in (7, 8):
        write(tmp_path, f"7/task/{tid}/schedstat", schedstat(0))
    write(tmp_path, "pressure/cpu", psi_cpu(0))
    w = CpuWatcher(str(tmp_path), worker_pids=lambda: [7])
    w.sample(0.0)
    # 1 s on two CPUs, both busy, all of it the worker's; its two threads waited 0.9 s each and
    # some task waited 0.8 s: the workers' own
    write(tmp_path, "stat", STAT.format(u=300, s=0, i=0, si=0, st=0) + "cpu1 100 0 0 0 0 0 0 0\n")
    write(tmp_path, "7/stat", pid_stat(7, "worker", 200, 0))
    for tid in (7, 8):
        write(tmp_path, f"7/task/{tid}/schedstat", schedstat(900_000_000))
    write(tmp_path, "pressure/cpu", psi_cpu(800_000))
    assert w.sample(1.0)["cpu_load"] == 0
    total = w.detail["total"]
    assert total["psi_some"] == pytest.approx(0.8) and total["workers_waiting"] == pytest.approx(1.8)
    assert total["psi_some_others"] == 0
    # the next second the worker's threads waited 0.4 s together: at least 0.6 - 0.4 / 2 of the
    # stall was others' (thread 8 exited, thread 9 is new: it counts from the next sample)
    write(tmp_path, "stat", STAT.format(u=500, s=0, i=0, si=0, st=0) + "cpu1 200 0 0 0 0 0 0 0\n")
    write(tmp_path, "7/stat", pid_stat(7, "worker", 400, 0))
    shutil.rmtree(tmp_path / "7/task/8")
    write(tmp_path, "7/task/7/schedstat", schedstat(1_300_000_000))
    write(tmp_path, "7/task/9/schedstat", schedstat(5_000_000_000))
    write(tmp_path, "pressure/cpu", psi_cpu(1_400_000))
    assert w.sample(2.0)["cpu_load"] == pytest.approx(0.6 - 0.4 / 2)
    # nobody waited: PSI says no more than the busy share, so the threads are not read next time
    write(tmp_path, "stat", STAT.format(u=700, s=0, i=0, si=0, st=0) + "cpu1 300 0 0 0 0 0 0 0\n")
    write(tmp_path, "7/stat", pid_stat(7, "worker", 600, 0))
    assert w.sample(3.0)["cpu_load"] == 0 and "workers_waiting" in w.detail["total"]
    write(tmp_path, "stat", STAT.format(u=900, s=0, i=0, si=0, st=0) + "cpu1 400 0 0 0 0 0 0 0\n")
    write(tmp_path, "7/stat", pid_stat(7, "worker", 800, 0))
    write(tmp_path, "pressure/cpu", psi_cpu(2_400_000))
    assert w.sample(4.0)["cpu_load"] == 0  # not read over this window: PSI left out, not counted whole
    assert "workers_waiting" not in w.detail["total"]
    # read again from the next sample on, which starts a window; the one after it is measured
    for t in (5, 6):
        write(tmp_path, "stat", STAT.format(u=100 + 200 * t, s=0, i=0, si=0, st=0) + f"cpu1 {100 * t} 0 0 0 0 0 0 0\n")
        write(tmp_path, "7/stat", pid_stat(7, "worker", 200 * t, 0))
        write(tmp_path, "pressure/cpu", psi_cpu(t * 1_000_000 - 1_600_000))
        assert w.sample(float(t))["cpu_load"] == (0 if t == 5 else pytest.approx(1.0))
    assert w.detail["total"]["workers_waiting"] == 0


def spinners_on_one_cpu(count: int, seconds: float) -> list[subprocess.Popen]:
    """`count` processes spinning on the machine's first allowed CPU, so that they wait for each other."""
    cpu = min(os.sched_getaffinity(0))
    code = f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nend = time.time() + {seconds}\n"
    code += "while time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def test_cpu_load_leaves_out_real_workers_waiting_for_each_other():
    """On this machine's kernel: three processes spinning on one CPU wait for each other most of
    the time (PSI cpu some), which is contention seen from outside them and none once they are the
    workers. Two watchers read the same moments."""
    if not os.path.exists("/proc/pressure/cpu"):
        pytest.skip("this kernel has no PSI (/proc/pressure/cpu): nothing to leave out")
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"):
        pytest.skip("this kernel keeps no per-thread schedstat (CONFIG_SCHED_INFO)")
    spinners = spinners_on_one_cpu(3, 30)
    try:
        as_workers = CpuWatcher(worker_pids=lambda: [p.pid for p in spinners])
        as_others = CpuWatcher()
        time.sleep(0.3)  # the interpreters have started spinning
        for w in (as_workers, as_others):
            w.sample(0.0)
        time.sleep(1.0)
        for w in (as_workers, as_others):
            w.sample(1.0)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    seen, named = as_others.detail["total"], as_workers.detail["total"]
    assert seen["psi_some"] > 0.4  # one CPU of the machine stalled nearly all the time
    assert named["workers_waiting"] == pytest.approx(2.0, abs=0.3)  # two of three wait at any time
    assert seen["psi_some_others"] == seen["psi_some"]  # nobody named: all of it others'
    assert named["psi_some_others"] < 0.1


def test_cpu_load_leaves_out_a_real_busy_worker_process():
    """On this machine's /proc: a process spinning on one CPU is load until it is named a worker.
    Two watchers read the same moments, so what the rest of the machine does cancels out."""
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]
    )
    try:
        as_worker, as_other = CpuWatcher(worker_pids=lambda: [spin.pid]), CpuWatcher()
        time.sleep(0.3)  # the interpreter has started spinning
        for w in (as_worker, as_other):
            w.sample(0.0)
        time.sleep(1.0)
        loads = [w.sample(1.0)["cpu_load"] for w in (as_worker, as_other)]
    finally:
        spin.kill()
        spin.wait()
    worker_view, other_view = ((t := w.detail["total"])["busy"] - t["workers"] for w in (as_worker, as_other))
    spun = as_worker.detail["total"]["workers"]
    assert spun == pytest.approx(1 / os.cpu_count(), abs=0.15)  # one CPU's worth of the machine
    assert other_view - worker_view == pytest.approx(spun, abs=0.02)
    assert loads[0] >= worker_view and loads[1] >= other_view  # PSI may only add to the share


def test_cpu_missing_file_is_reported_not_raised(tmp_path):
    w = CpuWatcher(str(tmp_path))
    assert w.sample(0) == {}
    assert not w.ok and "stat" in w.error
    assert "turbonode_cpu_collector_success 0.0" in scrape(w)


# ---- the workers' processes, read once a sample ---------------------------------------------


def test_the_workers_stat_is_read_once_a_sample_for_the_cpu_and_memory_watchers(tmp_path):
    """With 4 workers (8 processes) every per-process read counts at 10 samples a second: the cpu
    watcher (their CPU time) and the memory watcher (their major faults) share one read."""
    named = []

    def pids():
        named.append(1)
        return [41]

    write(tmp_path, "stat", STAT.format(u=100, s=50, i=800, si=10, st=5))
    write(tmp_path, "41/stat", pid_stat(41, "turboctl worker", 10, 5))
    write(tmp_path, "41/cgroup", "0::/\n")
    processes = WorkerProcesses(str(tmp_path), pids)
    cpu = CpuWatcher(str(tmp_path), processes=processes)
    memory = MemoryWatcher(str(tmp_path), cgroup_root=str(tmp_path / "none"), processes=processes)
    for w in (cpu, memory):
        w.sample(0.0)
    assert len(named) == 1
    write(tmp_path, "stat", STAT.format(u=150, s=75, i=820, si=30, st=25))
    write(tmp_path, "41/stat", pid_stat(41, "turboctl worker", 30, 5))
    assert cpu.sample(1.0)["cpu_load"] == pytest.approx((115 - 20) / 135)  # 115 busy, 20 the worker's
    assert memory.sample(1.0)["worker_major_faults_per_s"] == 0
    assert len(named) == 2 and memory.detail["worker_pids"] == [41]


def test_a_worker_process_that_exited_is_left_out():
    """On this machine's /proc: a named worker process is read while it runs (its CPU time grows),
    and left out once it has exited."""
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"]
    )
    try:
        processes = WorkerProcesses(pids=lambda: [spin.pid])
        first = process_cpu_ticks(process_stat_fields(read_text(f"/proc/{spin.pid}/stat")))
        assert processes.stat(0.0)[spin.pid][0] in "RSD"
        time.sleep(0.4)
        assert process_cpu_ticks(processes.stat(1.0)[spin.pid]) > first
        assert processes.stat(1.0) is processes.stat(1.0)  # one read for the sample at 1.0
    finally:
        spin.wait()
    assert processes.stat(2.0) == {}


def test_the_workers_cgroups_are_looked_up_for_new_processes_and_every_few_seconds(tmp_path):
    """Where a worker's processes are (their cgroup, its memory.pressure) is read for a new process
    at once and again every PLACEMENT_RECHECK_S, not at every sample (two files per process)."""
    root = tmp_path / "cgroup2"
    write(root, "cgroup.controllers", "cpu memory\n")
    for cg in ("a.service", "b.service"):
        write(root, f"{cg}/memory.current", "1\n")
        write(root, f"{cg}/memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
        write(root, f"{cg}/memory.pressure", "some avg10=0 avg60=0 avg300=0 total=0\n")
    for pid in (7, 8):
        write(tmp_path, f"proc/{pid}/stat", pid_stat(pid, "worker", 0, 0))
    write(tmp_path, "proc/7/cgroup", "0::/a.service\n")
    write(tmp_path, "proc/8/cgroup", "0::/b.service\n")
    pids = [7]
    w = MemoryWatcher(str(tmp_path / "proc"), lambda: pids, str(root))
    w.sample(0.0)
    assert w.detail["worker_psi_files"] == [str(root / "a.service/memory.pressure")]
    write(tmp_path, "proc/7/cgroup", "0::/b.service\n")  # moved: seen at the next look
    w.sample(1.0)
    assert w.detail["worker_psi_files"] == [str(root / "a.service/memory.pressure")]
    assert w.detail["cgroups"]["worker"]["cgroup"] == "/a.service"
    w.sample(PLACEMENT_RECHECK_S)
    assert w.detail["worker_psi_files"] == [str(root / "b.service/memory.pressure")]
    write(tmp_path, "proc/8/cgroup", "0::/a.service\n")
    pids[:] = [8]  # a restarted worker: looked up at once
    w.sample(PLACEMENT_RECHECK_S + 0.1)
    assert w.detail["worker_psi_files"] == [str(root / "a.service/memory.pressure")]


# ---- softnet_stat -----------------------------------------------------------------------


def softnet_row(processed, dropped, squeeze, ncols, cpu=None):
    cols = [processed, dropped, squeeze] + [0] * (ncols - 3)
    if cpu is not None and ncols > 12:
        cols[12] = cpu
    return " ".join(f"{c:08x}" for c in cols)


@pytest.mark.parametrize("ncols", [10, 11, 13])
def test_softnet_rates_for_each_column_layout(tmp_path, ncols):
    rows = lambda d, s: "\n".join([softnet_row(100, d, s, ncols, cpu=0), softnet_row(50, 0, 0, ncols, cpu=2)]) + "\n"
    write(tmp_path, "net/softnet_stat", rows(1, 2))
    w = SoftnetWatcher(str(tmp_path))
    w.sample(0)
    write(tmp_path, "net/softnet_stat", rows(5, 10))
    sig = w.sample(2.0)
    assert sig == {"softnet_dropped_per_s": 2.0, "softnet_squeezed_per_s": 4.0}
    # The CPU id column (5.10+) skips offline CPUs; older layouts number rows.
    assert set(w.detail["per_cpu_per_s"]) == ({0, 2} if ncols == 13 else {0, 1})


def test_softnet_rejects_truncated_row():
    with pytest.raises(ValueError, match="columns"):
        parse_softnet("0000000a 00000001\n")


# ---- PSI --------------------------------------------------------------------------------

PSI = "some avg10=1.50 avg60=0.20 avg300=0.00 total={some}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n"


def test_psi_stall_fraction_from_total(tmp_path):
    for res in ("cpu", "memory", "io"):
        write(tmp_path, f"pressure/{res}", PSI.format(some=1_000_000, full=0))
    w = PsiWatcher(str(tmp_path))
    w.sample(0)
    write(tmp_path, "pressure/cpu", PSI.format(some=1_250_000, full=0))
    sig = w.sample(0.5)
    assert sig["psi_cpu_some"] == pytest.approx(0.5) and sig["psi_memory_some"] == 0
    assert w.detail["cpu"]["some"]["avg10"] == 1.5


def test_psi_old_kernel_without_cpu_full_line(tmp_path):
    write(tmp_path, "pressure/cpu", "some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
    w = PsiWatcher(str(tmp_path))
    w.sample(0)
    assert w.ok and "psi_cpu_full" not in w.signals and "psi_cpu_some" in w.signals
    assert parse_pressure("some total=3\n") == {"some": {"total": 3.0}}


def test_missing_psi_is_a_reported_state(tmp_path):
    w = PsiWatcher(str(tmp_path))
    assert w.sample(0) == {} and not w.ok and "without PSI" in w.error
    trig = PsiTriggers(str(tmp_path))
    assert trig.fds == {} and "cpu" in trig.error


def fake_caps(root, cap_eff: int):
    write(root, "self/status", f"Name:\tpython3\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff:016x}\n")


@pytest.mark.parametrize(
    "cap_eff,spec,why",
    [
        (0x000001FFFFFFFFFF, b"some 100000 1000000\0", None),  # CAP_SYS_RESOURCE: 1 s windows
        (0x000001FFFEFFFFFF, b"some 200000 2000000\0", "no CAP_SYS_RESOURCE"),  # this VM's root: 2 s only
        (None, b"some 100000 1000000\0", None),  # unknown: 1 s first (2 s had the kernel refused it)
    ],
)
def test_psi_trigger_window_follows_cap_sys_resource(tmp_path, cap_eff, spec, why):
    if cap_eff is not None:
        fake_caps(tmp_path, cap_eff)
    for res in ("cpu", "memory", "io"):
        write(tmp_path, f"pressure/{res}", "")
    trig = PsiTriggers(str(tmp_path), stall_us_per_s=100_000)
    w = PsiWatcher(str(tmp_path), trig)
    try:
        assert sorted(trig.fds.values()) == ["cpu", "io", "memory"] and trig.error is None
        assert (tmp_path / "pressure/cpu").read_bytes() == spec  # what the kernel would have been asked
        assert set(w.wake_fds().values()) == {select.POLLPRI}
        window = w.summary()["triggers"]["window"]
        assert window.startswith(f"{int(spec[:-1].split()[2]) / 1e6:g} s")
        assert (why in window) if why else "(" not in window
    finally:
        w.close()
    assert trig.fds == {}


def test_psi_trigger_refusals_say_why():
    einval = OSError(errno.EINVAL, "Invalid argument")
    assert "1 s window needs CAP_SYS_RESOURCE" in _refusal(einval, 1_000_000, False)
    assert "before 5.2" in _refusal(einval, 2_000_000, False)
    assert "before 5.2" in _refusal(einval, 1_000_000, True)
    assert "psi=0" in _refusal(OSError(errno.EOPNOTSUPP, "Operation not supported"), 2_000_000, True)
    assert _refusal(PermissionError(errno.EACCES, "Permission denied"), 2_000_000, True) == "Permission denied"


# ---- softirqs ---------------------------------------------------------------------------


def test_proc_softirqs_fallback(tmp_path):
    text = (
        "                    CPU0       CPU1\n          HI:          1          0\n"
        "      NET_RX:        {a}        {b}\n BLOCK_IOPOLL:          0          0\n"
    )
    write(tmp_path, "softirqs", text.format(a=100, b=50))
    assert parse_softirqs(text.format(a=1, b=2))["BLOCK_IOPOLL"] == {"cpu0": 0, "cpu1": 0}
    w = SoftirqWatcher(str(tmp_path), use_bpf=False)
    w.sample(0)
    write(tmp_path, "softirqs", text.format(a=300, b=150))
    assert w.sample(1.0) == {"netrx_per_s": 300.0, "netrx_latency_p99_s": None}
    assert w.ok and w.mode == "procfs"
    assert "turbonode_softirq_collector_success 0.0" in scrape(w)  # counts alone: node_exporter's job


def test_log2_quantile_interpolates_inside_slot():
    counts = [0] * 32
    counts[10] = 99  # [512, 1024) ns
    counts[18] = 1  # [131072, 262144) ns
    assert 512e-9 <= quantile(counts, 0.5) < 1024e-9
    assert quantile(counts, 0.99) == pytest.approx(1024e-9)
    assert 131072e-9 < quantile(counts, 1.0) <= 262144e-9
    assert quantile([0] * 32, 0.99) is None


# ---- GPU (NVML cannot exist here: a fake stands in for the library) -----------------------


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, fail_init=False):
        self.fail_init = fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        pass

    UUIDS = ("GPU-0d1e", "GPU-8f2a")

    def nvmlDeviceGetCount(self):
        return len(self.UUIDS)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.UUIDS):
            raise self.NVMLError("Invalid Argument")
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.UUIDS:
            raise self.NVMLError("Not Found")
        return self.UUIDS.index(uuid)

    def nvmlDeviceGetIndex(self, h):
        return h

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 87 - 40 * h})

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": 3 << 30, "total": 80 << 30})

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0x4 | 0x40


def test_gpu_via_fake_nvml():
    w = GpuWatcher(FakeNvml())  # a node that names no workers: every GPU
    assert w.sample(0) == {"gpu_utilization": 0.87}
    text = scrape(w)
    assert 'turbonode_gpu_utilization_ratio{gpu="0"} 0.87' in text
    assert 'turbonode_gpu_utilization_ratio{gpu="1"} 0.47' in text
    assert 'turbonode_gpu_clocks_throttled{gpu="0",reason="hw_thermal_slowdown"} 1.0' in text
    assert 'turbonode_gpu_clocks_throttled{gpu="0",reason="gpu_idle"} 0.0' in text
    assert "turbonode_gpu_collector_success 1.0" in text


def test_a_workers_gpu_by_its_index_or_the_uuid_it_reports():
    said: dict = {"uuid": None}
    w = GpuWatcher(FakeNvml(), (1,), lambda: said["uuid"])  # [workers.<name>] gpu = 1
    assert w.sample(0) == {"gpu_utilization": 0.47} and [g["index"] for g in w.detail["gpus"]] == [1]
    said["uuid"] = "GPU-0d1e"  # the worker says which GPU it renders on: NVML's index 0 (a container's cuda:0)
    assert w.sample(2) == {"gpu_utilization": 0.87} and [g["index"] for g in w.detail["gpus"]] == [0]
    said["uuid"] = "GPU-dead"
    assert w.sample(4) == {} and "NVML query of GPU GPU-dead failed: Not Found" in w.error
    unknown = GpuWatcher(FakeNvml(), (), lambda: None)  # on CUDA, no index configured, not said yet
    assert unknown.sample(0) == {} and "no GPU known for this worker yet" in unknown.error
    seven = GpuWatcher(FakeNvml(), (7,))  # an index this host does not have
    assert seven.sample(0) == {} and "NVML query of GPU 7 failed: Invalid Argument" in seven.error


def test_absent_nvml_is_reported():
    w = GpuWatcher(FakeNvml(fail_init=True))
    assert w.sample(0) == {} and not w.ok and "Driver Not Loaded" in w.error
    assert "turbonode_gpu_collector_success 0.0" in scrape(w)


# ---- the real /proc of this machine -------------------------------------------------------


def test_real_proc_stat_softnet_and_psi():
    watchers = [CpuWatcher(), SoftnetWatcher(), PsiWatcher()]
    for w in watchers:
        w.sample(time.monotonic())
    time.sleep(0.3)
    sig = {}
    for w in watchers:
        sig.update(w.sample(time.monotonic()))
    assert watchers[0].ok and 0 <= sig["cpu_load"] <= 1
    assert watchers[1].ok and sig["softnet_dropped_per_s"] >= 0
    assert set(watchers[1].detail["per_cpu_per_s"]) >= {0}
    if not os.path.isdir("/proc/pressure"):
        pytest.skip("this kernel has no PSI")
    assert watchers[2].ok and 0 <= sig["psi_cpu_some"] <= 1
    trig = PsiTriggers()
    try:  # either armed or, where the kernel refuses triggers, reported
        assert trig.fds or trig.error
    finally:
        trig.close()


def _real_psi_skip_reason() -> str | None:
    if not os.path.isdir("/proc/pressure"):
        return "this kernel has no PSI"
    try:
        os.close(os.open("/proc/pressure/cpu", os.O_RDWR))
    except OSError as exc:
        return f"/proc/pressure/cpu not writable here: {exc.strerror}"
    return None


@pytest.mark.skipif(_real_psi_skip_reason() is not None, reason=_real_psi_skip_reason() or "")
def test_real_psi_trigger_window_and_retry(tmp_path):
    # Claim CAP_SYS_RESOURCE in a fake status, in front of the real pressure file: where this process
    # truly lacks it (root in a container, this VM) the kernel refuses the 1 s window with EINVAL and
    # the 2 s one is armed; where it has it, the 1 s one is.
    fake_caps(tmp_path, 0x000001FFFFFFFFFF)
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "cpu").symlink_to("/proc/pressure/cpu")
    trig = PsiTriggers(str(tmp_path), resources=("cpu",))
    try:
        assert trig.error is None and list(trig.fds.values()) == ["cpu"]
        held = (caps.effective() or 0) >> caps.CAP_SYS_RESOURCE & 1
        assert trig.window_us == (1_000_000 if held else 2_000_000)
        assert held or "the kernel refused 1 s" in trig.describe()["window"]
    finally:
        trig.close()


@pytest.mark.slow
@pytest.mark.skipif(_real_psi_skip_reason() is not None, reason=_real_psi_skip_reason() or "")
def test_real_psi_trigger_fires_under_cpu_pressure():
    trig = PsiTriggers(resources=("cpu",))  # the real /proc and this process's real capabilities
    assert trig.error is None, trig.error
    poller = select.poll()
    for fd, mask in PsiWatcher(triggers=trig).wake_fds().items():
        poller.register(fd, mask)
    spin = "import time\nend = time.monotonic() + 8\nwhile time.monotonic() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() + 1)]  # bounded: 8 s
    try:  # more runnable tasks than CPUs: some task always waits, well over 10 % of any window
        fired = poller.poll(3 * trig.window_us // 1000)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
        trig.close()
    assert fired and fired[0][1] & select.POLLPRI


def _nvml_skip_reason():
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return None if n else "NVML reports no GPU"
    except Exception as exc:
        return f"no NVIDIA GPU/driver here ({exc})"


@pytest.mark.gpu
@pytest.mark.skipif(_nvml_skip_reason() is not None, reason=_nvml_skip_reason() or "")
def test_real_nvml_gpu():
    w = GpuWatcher()
    sig = w.sample(0)
    assert w.ok, w.error
    assert 0 <= sig["gpu_utilization"] <= 1
    gpu = w.detail["gpus"][0]
    assert 0 < gpu["memory_total_bytes"] and 0 <= gpu["memory_used_bytes"] <= gpu["memory_total_bytes"]
    assert 'turbonode_gpu_memory_total_bytes{gpu="0"}' in scrape(w)
    w.close()


# ---- a source that answers nonsense ------------------------------------------------------

GOOD_STATUS = {"gc": {"last_seq": 1, "pauses": []}, "tiers": {"turbo": {"oldest_wait_s": 0.01}}}


@pytest.mark.parametrize(
    "status, error",
    [
        ([], "the worker's status answer is malformed: not an object: '[]'"),
        ({"tiers": "all of them"}, "malformed: 'str' object has no attribute 'get'"),
        ({"tiers": {"turbo": {"oldest_wait_s": "soon"}}}, "tiers.turbo.oldest_wait_s is not a number: 'soon'"),
        ({"tiers": {"turbo": {"oldest_wait_s": float("nan")}}}, "signal turbo_wait_s is not a finite number: nan"),
        ({"gc": {"last_seq": 2, "pauses": [{"seq": 2}]}}, "KeyError: 'pause_s'"),
    ],
    ids=["list", "tiers-a-string", "wait-a-string", "wait-nan", "pause-without-duration"],
)
def test_a_malformed_worker_status_fails_the_watcher_not_its_caller(tmp_path, status, error):
    """Whatever a worker answers, the watcher (or the thread that feeds it) reports the watcher
    as failed, names the error, and recovers when the source does. This worker has no `events`
    (an older one): the feed polls its status."""
    from agent.watchers.worker import WorkerWatcher
    from agent.watchers.worker_feed import WorkerFeed
    from bench.node import wait_for
    from turbonode.rpc_server import UnixRpcServer

    answer = {"status": GOOD_STATUS}
    path = str(tmp_path / "worker.sock")
    server = UnixRpcServer(path, {"status": lambda since_gc_seq=None: answer["status"]}).start()
    w = WorkerWatcher(WorkerFeed(path))
    news = lambda: w.due(0) and (w.sample(0) or True)  # noqa: E731  (the next sample with news)
    try:
        assert wait_for(lambda: news() and w.ok, 10), w.error
        answer["status"] = status
        assert wait_for(lambda: news() and not w.ok, 10)
        assert error in w.error, w.error
        assert w.view() == {"state": "absent", "error": w.error}
        answer["status"] = GOOD_STATUS
        assert wait_for(lambda: news() and w.ok, 10) and w.error is None
    finally:
        w.close()
        server.close()
