"""The worker's default intra-op threads and OpenMP wait policy (render/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from render.cpu_threads import DEFAULT_WAIT_POLICY, WAIT_POLICY_ENV, available_cpus, default_threads
from tests.helpers import ROOT


def test_one_cpu_is_left_to_the_rest_of_the_node():
    assert [default_threads(c) for c in (0.5, 1, 1.5, 2, 4, 16)] == [1, 1, 1, 1, 3, 15]


def fake_host(tmp_path: Path, quota: str, period: str = "100000") -> tuple[str, str]:
    procfs, cgroot = tmp_path / "proc", tmp_path / "cgroup"
    (procfs / "42").mkdir(parents=True)
    (procfs / "42" / "cgroup").write_text("3:cpuset:/\n1:cpu,cpuacct:/system.slice/w.service\n0::/\n")
    cg = cgroot / "cpu" / "system.slice" / "w.service"
    cg.mkdir(parents=True)
    (cgroot / "cpu" / "cpu.shares").write_text("1024\n")
    (cg / "cpu.cfs_quota_us").write_text(quota + "\n")
    (cg / "cpu.cfs_period_us").write_text(period + "\n")
    return str(procfs), str(cgroot)


def test_available_cpus_follow_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    procfs, cgroot = fake_host(tmp_path / "a", "150000")
    assert available_cpus(procfs, cgroot, 42) == min(affinity, 1.5)
    procfs, cgroot = fake_host(tmp_path / "b", "-1")
    assert available_cpus(procfs, cgroot, 42) == affinity
    # no cpu controller at all: the affinity is all there is
    assert available_cpus(procfs, str(tmp_path / "nowhere"), 42) == affinity


def test_a_parents_quota_caps_the_cpus_too(tmp_path):
    procfs, cgroot = fake_host(tmp_path, "-1")
    parent = Path(cgroot, "cpu", "system.slice")
    (parent / "cpu.cfs_quota_us").write_text("50000\n")  # a slice's CPUQuota=50%: all below it share it
    (parent / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(procfs, cgroot, 42) == 0.5
    Path(cgroot, "cpu", "system.slice", "w.service", "cpu.cfs_quota_us").write_text("20000\n")
    assert available_cpus(procfs, cgroot, 42) == 0.2  # the smallest cap on the path holds


def test_available_cpus_on_this_host():
    assert 0 < available_cpus() <= len(os.sched_getaffinity(0))


def test_passive_wait_is_the_default_and_the_environment_wins():
    code = "from render.cpu_threads import wait_policy_default; print(wait_policy_default())"
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == DEFAULT_WAIT_POLICY
    env[WAIT_POLICY_ENV] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"


PIN_AFTER_A_THREAD = """
import os, threading
from turbonode.affinity import pin_cpus
started, stop = threading.Event(), threading.Event()
def early():
    started.set()
    stop.wait()
    print(sorted(os.sched_getaffinity(0)))  # this thread's own, asked from inside it
threading.Thread(target=early).start()
started.wait()
pin_cpus(frozenset({CPU}))
print(sorted(os.sched_getaffinity(0)))
stop.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one CPU of several needs 2 CPUs")
def test_pinning_covers_the_threads_the_process_already_has():
    """A worker's thread started before `cpus` are applied (here one started first, as
    bench/garbage.py's is) runs on them too, not on the other workers' CPUs."""
    cpu = max(os.sched_getaffinity(0))
    code = PIN_AFTER_A_THREAD.replace("CPU", str(cpu))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [f"[{cpu}]", f"[{cpu}]"]
