"""Fixtures of the agent's tests: this host's real cpu cgroups, of each version."""

from __future__ import annotations

import os
import uuid

import pytest

from sandbox.cgroup_v2 import CgroupV2Unavailable, cpu_on_v2
from turbonode.cgroups import CgroupError, CpuHierarchy


def real_hierarchy() -> CpuHierarchy:
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    try:
        return CpuHierarchy.find()
    except CgroupError as exc:
        pytest.skip(f"no cgroup cpu controller to test on: {exc}")


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def hierarchy(request):
    """The real cpu hierarchy of each version: v1 as this hybrid host has it; v2 as a host with
    systemd >= 247 has it, where it is the host's own, or else with the cpu controller moved to
    the v2 mount for the module's tests and back (sandbox/cgroup_v2.py)."""
    h = real_hierarchy()
    if h.version == request.param:
        yield h
    elif request.param == 1:
        pytest.skip(f"the cpu controller is on cgroup v2 here ({h.mount}): no v1 to test")
    else:
        try:
            with cpu_on_v2() as v2:
                yield v2
        except CgroupV2Unavailable as exc:
            pytest.skip(f"cannot move the cpu controller to cgroup v2 here: {exc}")


@pytest.fixture
def real_cgroups(hierarchy):
    h = hierarchy
    tag = uuid.uuid4().hex[:8]
    names = [f"/tn-test-{tag}-worker", f"/tn-test-{tag}-batch"]
    made = []
    try:
        for name in names:
            h.create(name)
            made.append(name)
        yield h, names
    finally:
        for name in made:
            h.remove(name)
