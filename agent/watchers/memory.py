"""Memory pressure as the worker feels it: its major faults, its cgroup's pressure, and the memory
events of its cgroup and of the best-effort cgroups beside it.

  worker_major_faults_per_s  page faults of the worker's processes (pids from its status, as the
                             cpu watcher has them) that had to read the page back: its code and
                             mapped files reclaimed under it (/proc/PID/stat, majflt)
  worker_psi_memory_some     the stall fraction of a worker's own cgroup (its memory.pressure
                             in the v2 hierarchy, where per-cgroup PSI exists), the most stalled
                             worker's; None where the workers are in the v2 root: the node's
                             psi_memory_some is their pressure
  best_effort_memory_held    1 while a best-effort cgroup pushes against its own limit (the squeeze
                             lever's): its `max` (v1 failcnt) or `high` events count up, or (v1) its
                             tasks wait at the limit; else 0. It keeps the squeeze engaged while the
                             job would grow again, after the stall it caused has gone.

The node's PSI (psi_memory_some, psi_io_some) comes from the psi watcher. Events per cgroup
(turbonode/memory_cgroups.py: max, oom, oom_kill; low and high on v2) are counters in the detail
and in `turbonode_cgroup_memory_events_total`; a missing memory controller or cgroup is reported
in the detail and leaves the fault signal standing. One watcher for the node: every worker's
pids are passed in (the worker's memory cgroup in the detail is the first worker's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from turbonode.cgroups import CgroupError, slice_path
from turbonode.memory_cgroups import MemoryHierarchy, psi_file

from .base import MIN_RATE_WINDOW_S, Rate, Watcher
from .procfile import WorkerProcesses
from .psi import parse_pressure

MAJFLT = 9  # majflt is field 12 of a /proc/PID/stat line; process_stat_fields starts at field 3
# How often the workers' cgroups and memory.pressure files are looked up again while the same
# processes run (a new process is looked up at once): systemd puts a worker in its cgroup when it
# starts it, and nothing in the normal course moves it later.
PLACEMENT_RECHECK_S = 5.0


class Placement(NamedTuple):
    """Where the workers' processes are: the hierarchy, {label: cgroup} to read (the worker's and
    the best-effort ones), why some could not be found, and the workers' memory.pressure files."""

    hierarchy: MemoryHierarchy | None
    cgroups: dict[str, str]
    error: str | None
    psi_files: list[str]


def process_major_faults(fields: list[str]) -> int:
    """Major page faults so far (all threads) from a /proc/PID/stat line's fields (process_stat_fields)."""
    return int(fields[MAJFLT])


class MemoryWatcher(Watcher):
    name = "memory"
    interval = MIN_RATE_WINDOW_S

    def __init__(
        self,
        procfs: str = "/proc",
        worker_pids: Callable[[], Iterable[int]] = tuple,
        cgroup_root: str = "/sys/fs/cgroup",
        worker_cgroup: str = "auto",
        best_effort: Sequence[str] = (),
        processes: WorkerProcesses | None = None,  # the workers' stat, read once a sample for every watcher
    ):
        super().__init__()
        self.procfs, self.cgroup_root = procfs, cgroup_root
        self.processes = processes or WorkerProcesses(procfs, worker_pids)
        self.worker_cgroup, self.best_effort = worker_cgroup, tuple(best_effort)
        self._rate = Rate()
        self.major_faults_total = 0.0  # the worker's, accumulated over its restarts
        self._last_faults: dict[int, int] = {}
        self._placed: tuple[tuple[int, ...], float, Placement] | None = None

    def _placement(self, pids: list[int], now: float) -> Placement:
        """Where the workers' processes are: looked up for a new set of processes, and again
        every PLACEMENT_RECHECK_S (each lookup reads a file or two per process)."""
        key = tuple(pids)
        if self._placed is None or self._placed[0] != key or now - self._placed[1] >= PLACEMENT_RECHECK_S:
            h, cgroups, error = self._cgroups(pids)
            self._placed = (key, now, Placement(h, cgroups, error, self._psi_files(pids)))
        return self._placed[2]

    def _cgroups(self, pids: list[int]) -> tuple[MemoryHierarchy | None, dict[str, str], str | None]:
        """The hierarchy, {label: cgroup} to read, and why some could not be."""
        try:
            h = MemoryHierarchy.find(self.cgroup_root)
        except CgroupError as exc:
            return None, {}, str(exc)
        out = {cg: slice_path(cg) for cg in self.best_effort}
        try:
            if self.worker_cgroup == "auto" and pids:
                cg = h.of_pid(pids[0], self.procfs)
            else:
                cg = slice_path(self.worker_cgroup) if self.worker_cgroup not in ("", "auto") else "/"
        except CgroupError as exc:
            return h, out, str(exc)
        if cg != "/":
            out["worker"] = cg
        return h, out, None

    def _psi_files(self, pids: list[int]) -> list[str]:
        """The memory.pressure file of each worker's v2 cgroup (its processes share it), once each."""
        files: dict[str, None] = {}
        for pid in pids:
            try:
                path = psi_file(self.cgroup_root, pid, "memory", self.procfs)
            except CgroupError:  # exited since its status named it
                continue
            if path is not None:
                files[path] = None
        return list(files)

    def read(self, now):
        faults = {}
        for pid, fields in self.processes.stat(now).items():
            try:
                faults[pid] = process_major_faults(fields)
            except (ValueError, IndexError):  # not a stat line: not the worker's
                continue
        for pid, n in faults.items():  # a new pid (a restarted worker) counts from its first sample
            self.major_faults_total += max(0, n - self._last_faults.get(pid, n))
        self._last_faults = faults
        counters: dict = {("majflt", pid): n for pid, n in faults.items()}
        h, cgroups, error, psi = self._placement(list(faults), now)
        per_cgroup: dict[str, dict] = {}
        waiting = False
        for label, cg in cgroups.items():
            assert h is not None
            try:
                events = h.events(cg)
                per_cgroup[label] = {"cgroup": cg, "usage_bytes": h.usage(cg), "events": events}
                if label != "worker":
                    counters[("limited", cg)] = events.get("max", 0) + events.get("high", 0)
                    waiting = waiting or h.waiting_at_limit(cg)
            except (CgroupError, ValueError) as exc:
                per_cgroup[label] = {"cgroup": cg, "error": str(exc)}
        for path in psi:
            try:
                with open(path) as f:
                    counters[("psi", path)] = parse_pressure(f.read())["some"]["total"] / 1e6
            except (OSError, ValueError, KeyError):  # its cgroup went with its worker
                continue
        rates = self._rate.update(now, counters)
        signals = {
            "worker_major_faults_per_s": (
                sum(r for k, r in rates.items() if k[0] == "majflt") if rates is not None and faults else None
            ),
            # the most stalled worker's: a rule on it acts for that worker's sake
            "worker_psi_memory_some": max((r for k, r in (rates or {}).items() if k[0] == "psi"), default=None),
            "best_effort_memory_held": (
                float(waiting or any(r > 0 for k, r in rates.items() if k[0] == "limited"))
                if rates is not None and self.best_effort
                else None
            ),
        }
        detail = {"worker_pids": sorted(faults), "worker_psi_files": psi, "cgroups": per_cgroup, "cgroup_error": error}
        return signals, detail

    def summary(self) -> dict:
        return {
            **super().summary(),
            "cgroups": self.detail.get("cgroups"),
            "cgroup_error": self.detail.get("cgroup_error"),
        }

    def families(self):
        faults = CounterMetricFamily(
            "turbonode_worker_major_faults", "Major page faults of the worker's processes (code or files read back)"
        )
        faults.add_metric([], self.major_faults_total)
        events = CounterMetricFamily(
            "turbonode_cgroup_memory_events",
            "Memory events of the worker's and the best-effort cgroups (max: hit the limit; oom_kill: a task killed)",
            labels=["cgroup", "event"],
        )
        usage = GaugeMetricFamily(
            "turbonode_cgroup_memory_usage_bytes",
            "Memory charged to the worker's and the best-effort cgroups",
            labels=["cgroup"],
        )
        for row in (self.detail.get("cgroups") or {}).values():
            for event, n in (row.get("events") or {}).items():
                events.add_metric([row["cgroup"], event], n)
            if "usage_bytes" in row:
                usage.add_metric([row["cgroup"]], row["usage_bytes"])
        return [faults, events, usage]
