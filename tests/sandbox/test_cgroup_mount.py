"""A sandbox node's worker sees its cgroups inside `ip netns exec` (sandbox/cgroup_mount.py): the
command for each layout, and for real, a worker-like program that reads a parent's CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from sandbox.cgroup_mount import remount, seeing
from tests.helpers import ROOT, needs_root
from turbonode.cgroups import CgroupError, CpuHierarchy


def test_a_v2_root_is_mounted_as_it_is(tmp_path):
    assert remount(CpuHierarchy(str(tmp_path), 2), str(tmp_path)) == f"mount -t cgroup2 cgroup2 {tmp_path}"


def test_a_v1_mount_gets_its_controllers_and_the_link_to_it(tmp_path):
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "cpu").symlink_to("cpu,cpuacct")
    assert remount(CpuHierarchy(str(tmp_path / "cpu"), 1), str(tmp_path)) == (
        f"mount -t tmpfs cgroups {tmp_path} && mkdir -p {tmp_path}/cpu,cpuacct && "
        f"mount -t cgroup -o cpu,cpuacct cgroup {tmp_path}/cpu,cpuacct && ln -s cpu,cpuacct {tmp_path}/cpu"
    )


def test_a_hybrid_hosts_v2_mount_goes_below_a_tmpfs(tmp_path):
    (tmp_path / "unified").mkdir()
    assert remount(CpuHierarchy(str(tmp_path / "unified"), 2), str(tmp_path)) == (
        f"mount -t tmpfs cgroups {tmp_path} && mkdir -p {tmp_path}/unified && "
        f"mount -t cgroup2 cgroup2 {tmp_path}/unified"
    )


def test_without_a_hierarchy_the_argv_is_left_alone():
    assert seeing(None, ["turboctl", "worker", "run"]) == ["turboctl", "worker", "run"]


@needs_root
def test_inside_ip_netns_exec_a_program_sees_its_parents_cpu_quota():
    try:
        cgroups = CpuHierarchy.find()
    except CgroupError as exc:
        pytest.skip(f"no cgroup cpu controller: {exc}")
    top, ns = f"/tnx-{uuid.uuid4().hex[:8]}", f"tnx-{uuid.uuid4().hex[:8]}"
    made: list[str] = []
    try:
        for cg in (top, f"{top}/worker"):
            cgroups.create(cg)
            made.append(cg)
        for path, value in cgroups.quota_writes(top, 0.5):
            with open(path, "w") as f:
                f.write(value)
        subprocess.run(["ip", "netns", "add", ns], check=True)
        read = "from render.cpu_threads import available_cpus; print(available_cpus())"
        inner = ["ip", "netns", "exec", ns, *seeing(cgroups, [sys.executable, "-c", read])]
        moved = f'echo $$ > {cgroups.procs_file(f"{top}/worker")} && exec "$@"'
        plain = subprocess.run(
            ["sh", "-c", moved, "sh", "ip", "netns", "exec", ns, sys.executable, "-c", read],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        seen = subprocess.run(
            ["sh", "-c", moved, "sh", *inner],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert seen.returncode == 0 and float(seen.stdout) == 0.5, seen
        # without it, `ip netns exec` hides the quota: the affinity is all the program sees
        assert float(plain.stdout) == len(os.sched_getaffinity(0)), plain
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for cg in reversed(made):
            cgroups.remove(cg)
