"""CPU utilisation from /proc/stat, busy time including irq, softirq and steal.

Parsed here rather than through psutil so the procfs root is honoured (psutil keeps one
global PROCFS_PATH). Older kernels have fewer columns (no steal before 2.6.11, no guest
before 2.6.24): missing ones count as zero.
"""

from __future__ import annotations

import os

from .base import MIN_RATE_WINDOW_S, Rate, Watcher

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

    def __init__(self, procfs: str = "/proc"):
        super().__init__()
        self.path = os.path.join(procfs, "stat")
        self._rate = Rate()

    def read(self, now):
        with open(self.path) as f:
            stat = parse_stat(f.read())
        flat = {(cpu, col): v for cpu, cols in stat.items() for col, v in cols.items()}
        rates = self._rate.update(now, flat)
        if rates is None:
            return {"cpu_load": None}, {}
        per_cpu = {cpu: shares({col: r for (c, col), r in rates.items() if c == cpu}) for cpu in stat}
        total = per_cpu.pop("cpu")
        signals = {"cpu_load": total.get("busy"), "cpu_softirq": total.get("softirq"), "cpu_steal": total.get("steal")}
        return signals, {"total": total, "per_cpu": per_cpu}
