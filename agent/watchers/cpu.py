"""CPU contention: busy time (including irq, softirq and steal) that is not the workers' own, or
time other tasks spent waiting for a CPU.

A busy worker on an otherwise idle node is no degradation: on a slower machine its own compute
alone would hold the node's CPUs busy and engage the levers against nobody. So `cpu_load` is
the larger of two fractions over the same window:
- the share of all CPU time that others took: busy time (/proc/stat) less what the worker's
  processes used (their pids from its status, CPU time from /proc/PID/stat);
- PSI cpu `some` (/proc/pressure/cpu), the share of time at least one task waited for a CPU, less
  what the workers' own threads waited (/proc/PID/task/TID/schedstat).
The first works on kernels without PSI; the second keeps the rule active while its own lever
works: a hog that `cpu_share` holds back takes little CPU time, but its tasks still wait (node
SLO, `all` cell: with the share alone the lever let go and turbo's p99 rose from 439 to 637 ms;
docs/benchmarks.md). A worker's threads also wait behind each other (its engine's intra-op
threads, its front), which is not contention either: counted, the idle two-worker node read
pressured most of the time (docs/benchmarks.md). The kernel's `some` averages the CPUs' stall
shares weighted by their non-idle time, and a CPU's share is at most the workers' waiting plus
the others' on it, so `some - W / B` (W: the workers' threads waiting per second, summed;
B: busy CPUs) is a lower bound of the others' waits: the workers' own part is never counted, a
hog held back still is. `detail["total"]` keeps the whole picture: the workers' share, the PSI
fraction, the workers' waiting and what is left of PSI for the others. Reading every thread's
schedstat costs ~10 us a thread here (0.4 ms for a 41-thread process, each sample): the threads
are read only while PSI says more than the busy share did in the sample before; in the first
window after a pause their waits are unknown, and PSI is then left out rather than counted whole.

Parsed here rather than through psutil so the procfs root is honoured (psutil keeps one
global PROCFS_PATH). Older kernels have fewer columns (no steal before 2.6.11, no guest
before 2.6.24): missing ones count as zero; without schedstat the workers' waits read zero
(PSI some counts whole, as before).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from .base import MIN_RATE_WINDOW_S, Rate, Watcher
from .procfile import WorkerProcesses, read_text, thread_run_delays
from .psi import parse_pressure

COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")  # guest* are inside user/nice


def parse_stat(text: str) -> dict[str, dict[str, int]]:
    """'cpu' and 'cpuN' lines -> {name: {column: jiffies}}."""
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        out[fields[0]] = {col: int(v) for col, v in zip(COLUMNS, fields[1:])}
    if "cpu" not in out:
        raise ValueError("/proc/stat has no aggregate 'cpu' line")
    return out


def process_cpu_ticks(fields: list[str]) -> int:
    """utime + stime (clock ticks, all threads) from a /proc/PID/stat line's fields (process_stat_fields)."""
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of the line; state is field 3


def shares(delta: dict[str, float]) -> dict[str, float]:
    total = sum(delta.get(c, 0) for c in COLUMNS)
    if total <= 0:
        return {}
    out = {c: delta.get(c, 0) / total for c in COLUMNS}
    out["busy"] = 1 - out["idle"] - out["iowait"]
    return out


class CpuWatcher(Watcher):
    name = "cpu"
    interval = MIN_RATE_WINDOW_S

    def __init__(
        self,
        procfs: str = "/proc",
        worker_pids: Callable[[], Iterable[int]] = tuple,
        processes: WorkerProcesses | None = None,  # the workers' stat, read once a sample for every watcher
    ):
        super().__init__()
        self.procfs = procfs
        self.path = os.path.join(procfs, "stat")
        self.pressure = os.path.join(procfs, "pressure", "cpu")
        self.processes = processes or WorkerProcesses(procfs, worker_pids)
        self._rate = Rate()
        self._waits = Rate()  # the workers' threads' waits, while they are read (_read_waits)
        self._read_waits = True  # whether PSI said more than the busy share in the sample before

    def _worker_ticks(self, now: float) -> dict[tuple[str, int], int]:
        """CPU ticks so far of each worker process that still exists (one that exited, or a
        restarted worker's new pid, counts from the sample after it is first seen)."""
        ticks = {}
        for pid, fields in self.processes.stat(now).items():
            try:
                ticks[("worker", pid)] = process_cpu_ticks(fields)
            except (ValueError, IndexError):  # not a stat line: not the worker's
                continue
        return ticks

    def _workers_waited_s(self, now: float) -> dict[tuple[str, int], float]:
        """Seconds so far that each thread of the workers' processes waited for a CPU."""
        return {
            ("waited", tid): s
            for pid in self.processes.stat(now)
            for tid, s in thread_run_delays(self.procfs, pid).items()
        }

    def _waiting_s(self) -> dict[tuple[str, str], float]:
        """Seconds so far that some task waited for a CPU; none on a kernel without PSI."""
        try:
            return {("psi", "some"): parse_pressure(read_text(self.pressure))["some"]["total"] / 1e6}
        except (OSError, ValueError, KeyError):
            return {}

    def read(self, now):
        stat = parse_stat(read_text(self.path))
        flat: dict = {(cpu, col): v for cpu, cols in stat.items() for col, v in cols.items()}
        flat.update(self._worker_ticks(now))
        flat.update(self._waiting_s())
        if self._read_waits:
            waits = self._waits.update(now, self._workers_waited_s(now))
        else:
            waits, self._waits = None, Rate()  # the next read starts a window
        rates = self._rate.update(now, flat)
        if rates is None:
            return {"cpu_load": None}, {}
        per_cpu = {cpu: shares({col: r for (c, col), r in rates.items() if c == cpu}) for cpu in stat}
        total = per_cpu.pop("cpu")
        if not total:  # no CPU time passed between the two reads
            return {"cpu_load": None}, {}
        all_time = sum(rates.get(("cpu", col), 0) for col in COLUMNS)
        workers = sum(r for (kind, _), r in rates.items() if kind == "worker")
        # /proc/stat and /proc/PID/stat both count USER_HZ ticks; read a moment apart, the
        # workers' share may come out a tick above the busy share: others then took nothing.
        total["workers"] = min(workers / all_time, total["busy"])
        contention = total["busy"] - total["workers"]
        if ("psi", "some") in rates:  # seconds waited per second of wall time
            total["psi_some"] = min(rates[("psi", "some")], 1.0)
            self._read_waits = total["psi_some"] > contention
            if waits is None:  # not read over this window: all of it may be the workers' own
                total["psi_some_others"] = 0.0
            else:  # the workers' threads waiting, on average (they may wait on several CPUs at once)
                total["workers_waiting"] = sum(waits.values())
                busy_cpus = total["busy"] * max(len(per_cpu), 1)
                own = min(1.0, total["workers_waiting"] / busy_cpus) if busy_cpus > 0 else 0.0
                total["psi_some_others"] = max(0.0, total["psi_some"] - own)
            contention = max(contention, total["psi_some_others"])
        signals = {
            "cpu_load": contention,
            "cpu_softirq": total.get("softirq"),
            "cpu_steal": total.get("steal"),
        }
        return signals, {"total": total, "per_cpu": per_cpu}
