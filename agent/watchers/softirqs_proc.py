"""/proc/softirqs: softirq counts per vector and CPU, the fallback where BPF is unavailable.

Counts only (no time, no latency). Header row names the CPUs; vectors vary by kernel
(IRQ_POLL was BLOCK_IOPOLL before 4.5), so rows are read by name.
"""

from __future__ import annotations

import os


def parse_softirqs(text: str) -> dict[str, dict[str, int]]:
    """-> {vector: {cpuN: count}}."""
    lines = text.splitlines()
    if not lines:
        raise ValueError("/proc/softirqs is empty")
    cpus = [c.lower() for c in lines[0].split()]
    out = {}
    for line in lines[1:]:
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        counts = [int(x) for x in rest.split()]
        out[name.strip()] = dict(zip(cpus, counts))
    return out


def read_softirqs(procfs: str = "/proc") -> dict[str, dict[str, int]]:
    with open(os.path.join(procfs, "softirqs")) as f:
        return parse_softirqs(f.read())
