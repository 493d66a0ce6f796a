"""/proc/net/softnet_stat: packets dropped (backlog full) and time squeezes per CPU.

One line per online CPU, hex columns. Column count grew over the years (9 .. 13): read
what is there by position; the CPU id is column 12 where present (5.10+), else the row.
"""

from __future__ import annotations

import os

from .base import MIN_RATE_WINDOW_S, Rate, Watcher
from .procfile import read_text

PROCESSED, DROPPED, TIME_SQUEEZE, CPU_ID = 0, 1, 2, 12


def parse_softnet(text: str) -> dict[int, dict[str, int]]:
    out = {}
    for row, line in enumerate(text.splitlines()):
        cols = [int(x, 16) for x in line.split()]
        if len(cols) < 3:
            raise ValueError(f"softnet_stat row {row} has {len(cols)} columns, need at least 3")
        cpu = cols[CPU_ID] if len(cols) > CPU_ID else row
        out[cpu] = {"processed": cols[PROCESSED], "dropped": cols[DROPPED], "time_squeeze": cols[TIME_SQUEEZE]}
    return out


class SoftnetWatcher(Watcher):
    name = "softnet"
    interval = MIN_RATE_WINDOW_S

    def __init__(self, procfs: str = "/proc"):
        super().__init__()
        self.path = os.path.join(procfs, "net", "softnet_stat")
        self._rate = Rate()

    def read(self, now):
        stat = parse_softnet(read_text(self.path))
        rates = self._rate.update(now, {(cpu, k): v for cpu, cols in stat.items() for k, v in cols.items()})
        if rates is None:
            return {"softnet_dropped_per_s": None, "softnet_squeezed_per_s": None}, {}
        per_cpu = {cpu: {k: rates[(cpu, k)] for k in cols} for cpu, cols in stat.items()}
        signals = {
            "softnet_dropped_per_s": sum(c["dropped"] for c in per_cpu.values()),
            "softnet_squeezed_per_s": sum(c["time_squeeze"] for c in per_cpu.values()),
        }
        return signals, {"per_cpu_per_s": per_cpu}
