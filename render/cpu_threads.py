"""How many intra-op threads the worker's torch runs, and how they wait at barriers.

Measured on the 2-core development VM (notes in docs/benchmarks.md, bench/node_slo.py): with
as many OpenMP threads as CPUs and OpenMP's default spin-then-sleep wait, any other runnable
task (a CPU hog, the worker's own HTTP and PNG threads, the network stack) deschedules one
thread and the others stall at every barrier: a tiny-UNet step went from 21 ms to a p99 of
0.65-2.2 s under stress-ng. With one CPU left to everything else, the step p99 stayed at
53-85 ms under the same hog, and idle cost 26 ms instead of 21 ms. So by default the worker
runs one thread fewer than the CPUs it may use (affinity, capped by its cgroup's CPU quota),
at least one, and its threads sleep at barriers (OMP_WAIT_POLICY=PASSIVE: free at one thread,
and 2 threads under the hog kept a p99 of 0.08-0.17 s instead of seconds). The wait policy is
read once, when OpenMP starts with torch's import: `wait_policy_default()` must run first. The
agent may lower the thread count at run time through the throttle (`intra_op_threads`).
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping

from turbonode.cgroups import CGROUP_ROOT, CgroupError, CpuHierarchy

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"


def wait_policy_default(env: MutableMapping[str, str] | None = None) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment already chose; call before importing torch."""
    target = os.environ if env is None else env
    return target.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def available_cpus(procfs: str = "/proc", cgroup_root: str = CGROUP_ROOT, pid: int | str = "self") -> float:
    """CPUs this process may run on, capped by the CPU quota of its cgroup or a parent's where
    there is one."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        hierarchy = CpuHierarchy.find(cgroup_root)
        quota = hierarchy.quota_cpus_within(hierarchy.of_pid(pid, procfs))
    except CgroupError:
        return cpus  # no cpu controller, or not readable: the affinity is all we know
    return min(cpus, quota) if quota is not None else cpus


def default_threads(cpus: float) -> int:
    """One CPU left to the rest of the node, at least one thread."""
    return max(1, math.ceil(cpus) - 1)
