"""Where a sandbox worker's CPU time goes between two moments (bench/capacity.py, per rung).

A reading holds each thread's CPU time of the worker's two processes (procfs: the front and the
engine process, found by the worker's control socket `status` pids), the node cgroup's quota
throttling (cpu.stat), and the engine's counters from its
/metrics (steps, images per step, decodes, their wall time, jobs done). `split` turns two
readings into per-image figures. Threads carry no names here (CPython leaves the OS name alone),
so the engine process's busiest thread is reported as its render loop and the rest as its
other threads (the sender thread's PNG encoding, the calls' pickling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from turbonode.cgroups import CgroupError, CpuHierarchy

TICKS = os.sysconf("SC_CLK_TCK")
# /metrics samples a split reads: (metric sample name, label that must match or None)
COUNTERS = {
    "steps": "turbonode_worker_step_duration_seconds_count",
    "step_s": "turbonode_worker_step_duration_seconds_sum",
    "step_images": "turbonode_worker_batch_images_sum",
    "decodes": "turbonode_worker_decode_duration_seconds_count",
    "decode_s": "turbonode_worker_decode_duration_seconds_sum",
}
JOBS_DONE = "turbonode_worker_jobs_total"


@dataclass
class Reading:
    threads: dict[str, dict[int, float]] = field(default_factory=dict)  # process role -> tid -> CPU s
    throttled_s: float | None = None  # time the node's quota held the node's tasks off the CPU
    engine: dict[str, float] = field(default_factory=dict)  # COUNTERS and jobs_done, from /metrics


def thread_cpu(pid: int, procfs: str = "/proc") -> dict[int, float]:
    """Each thread's user + system CPU seconds; {} when the process is gone."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"{procfs}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{procfs}/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)
    return out


def throttled(hierarchy: CpuHierarchy, cgroup: str) -> float | None:
    """Seconds `cgroup`'s CPU quota held its tasks off the CPU (v1 throttled_time, v2 throttled_usec)."""
    try:
        stat = dict(line.split() for line in hierarchy.read(cgroup, "cpu.stat").splitlines())
        return int(stat["throttled_usec"]) / 1e6 if "throttled_usec" in stat else int(stat["throttled_time"]) / 1e9
    except (CgroupError, ValueError, KeyError):
        return None


def engine_counters(metrics_text: str, tier: str) -> dict[str, float]:
    """The engine's COUNTERS, and `tier`'s jobs done as jobs_done, from a /metrics page."""
    want = {name: key for key, name in COUNTERS.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in want:
                out[want[s.name]] = s.value
            elif s.name == JOBS_DONE and s.labels.get("tier") == tier and s.labels.get("outcome") == "done":
                out["jobs_done"] = s.value
    return out


def split(before: Reading, after: Reading, images: int) -> dict:
    """CPU ms per image between two readings: the engine's render loop, its other threads, the
    front; images per step and per decode; step and decode wall ms per image; seconds throttled."""
    per = 1000 / images if images else 0.0

    def delta(role: str) -> list[float]:
        a, b = before.threads.get(role, {}), after.threads.get(role, {})
        return sorted((b[t] - a.get(t, 0.0) for t in b), reverse=True)

    engine, front = delta("engine"), delta("front")
    e = {k: after.engine.get(k, 0.0) - before.engine.get(k, 0.0) for k in (*COUNTERS, "jobs_done")}
    out = {
        "images": images,
        "engine_loop_ms": engine[0] * per if engine else None,
        "engine_other_ms": sum(engine[1:]) * per if engine else None,
        "front_ms": sum(front) * per if front else None,
        "throttled_s": None,
        "images_per_step": e["step_images"] / e["steps"] if e["steps"] else None,
        "images_per_decode": e["jobs_done"] / e["decodes"] if e["decodes"] else None,
        "step_wall_ms": e["step_s"] * per,
        "decode_wall_ms": e["decode_s"] * per,
    }
    if before.throttled_s is not None and after.throttled_s is not None:
        out["throttled_s"] = after.throttled_s - before.throttled_s
    return out
