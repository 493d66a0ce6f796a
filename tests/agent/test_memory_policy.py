"""The memory and io rules' choices with a fake clock (pure: the default policy, recorded signals):
what a burst of the worker's major faults engages, how long the squeeze holds while the job
pushes, and what the io stall engages; and a real io cgroup favoured with what this kernel offers
(weights where a proportional io policy schedules the disk, else the best-effort writes capped: a
direct writer held to the cap) and put back."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from agent.levers.cgroup import WorkerCgroup
from agent.levers.io import IoThrottle, IoWeight, node_io_policy
from agent.levers.io_policy import OFF
from agent.levers.journal import KnobJournal, KnobWrites
from agent.policy import policy_from_config
from turbonode import block_devices
from turbonode.cgroups import CgroupError
from turbonode.config import MEMORY_EXIT_S, AgentConfig, LeversConfig, PolicyConfig
from turbonode.levels import LEVELS
from turbonode.memory_cgroups import IoHierarchy

PERIOD = AgentConfig().sample_period
MEMORY_LEVERS = {"memory_squeeze", "memory_protect"}


def feed(policy, samples: list[dict], start: float = 0.0) -> list:
    return [policy.update(s, start + i * PERIOD) for i, s in enumerate(samples)]


def levers(decision) -> set[str]:
    return {name for name, _ in decision.levers}


def test_a_fault_burst_protects_the_worker_and_squeezes_and_they_hold_while_the_job_pushes():
    p = policy_from_config(PolicyConfig())
    quiet = {"worker_major_faults_per_s": 0.0, "psi_memory_some": 0.0, "best_effort_memory_held": 0.0}
    d = feed(p, [quiet] * 10)
    assert d[-1].level_name == "normal" and not levers(d[-1])
    # the node reaches its limit: the worker's code faults back in, hundreds a second
    burst = {**quiet, "worker_major_faults_per_s": 480.0}
    d = feed(p, [burst] * 2, start=1.0)
    assert not levers(d[-1])  # 0.1 s of evidence: not yet (enter_s 0.3)
    d = feed(p, [burst] * 3, start=1.2)
    assert levers(d[-1]) == MEMORY_LEVERS
    assert str(dict(d[-1].levers)["memory_squeeze"]) == "worker_major_faults_per_s=480 > 50"
    assert d[-1].level_name == "normal"  # levers only: the level's throttle takes no page from the job
    # protected and held: the faults stop, the held job pushes against its limit for a minute
    held = {**quiet, "best_effort_memory_held": 1.0}
    d = feed(p, [held] * 600, start=1.5)
    assert all(levers(x) == MEMORY_LEVERS for x in d)
    # the job ended (or gave memory back): the faults' 30 s of calm (MEMORY_EXIT_S) are long past,
    # so the levers go with the held rule, after its 3 s
    d = feed(p, [quiet] * 40, start=61.5)
    assert levers(d[25]) == MEMORY_LEVERS and not levers(d[-1])


def test_after_a_fault_burst_the_levers_wait_30_s_of_calm():
    """Released at once, the worker's unlocked pages go back to the reclaimable lists while the job
    may still be there: its next push evicts them again (node SLO memory cell)."""
    p = policy_from_config(PolicyConfig())
    d = feed(p, [{"worker_major_faults_per_s": 480.0}] * 5)
    assert levers(d[-1]) == MEMORY_LEVERS
    d = feed(p, [{"worker_major_faults_per_s": 0.0}] * int(MEMORY_EXIT_S / PERIOD + 10), start=0.5)
    assert levers(d[int((MEMORY_EXIT_S - 1) / PERIOD)]) == MEMORY_LEVERS and not levers(d[-1])


def test_the_node_stall_engages_the_same_levers_and_noise_below_enter_does_not():
    p = policy_from_config(PolicyConfig())
    d = feed(p, [{"psi_memory_some": v} for v in [0.05, 0.08, 0.06, 0.09] * 25])
    assert not any(levers(x) for x in d)
    d = feed(p, [{"psi_memory_some": 0.3}] * 5, start=10.0)
    assert levers(d[-1]) == MEMORY_LEVERS


def test_the_workers_own_stall_on_v2_engages_them_and_none_on_v1_never_does():
    p = policy_from_config(PolicyConfig())
    d = feed(p, [{"worker_psi_memory_some": None, "psi_memory_some": 0.05}] * 50)  # v1: no such file
    assert not any(levers(x) for x in d)
    d = feed(p, [{"worker_psi_memory_some": 0.4, "psi_memory_some": 0.05}] * 5, start=5.0)
    assert levers(d[-1]) == MEMORY_LEVERS and d[-1].level_name == "normal"
    assert str(dict(d[-1].levers)["memory_protect"]) == "worker_psi_memory_some=0.4 > 0.1"


def test_the_io_stall_engages_the_io_levers_only():
    p = policy_from_config(PolicyConfig())
    d = feed(p, [{"psi_io_some": 0.2}] * 20)
    assert not any(levers(x) for x in d)  # below enter (0.30)
    d = feed(p, [{"psi_io_some": 0.6}] * 5, start=2.0)
    assert levers(d[-1]) == {"io_weight", "io_throttle"} and LEVELS[d[-1].level] == "normal"  # io only
    d = feed(p, [{"psi_io_some": 0.0}] * 40, start=2.5)
    assert levers(d[20]) == {"io_weight", "io_throttle"} and not levers(d[-1])  # its 3 s of calm


def throttle_lines(h: IoHierarchy, cgroup: str) -> list[str]:
    """The per-device write caps of `cgroup`: io.max lines on v2, blkio.throttle.write_bps_device on v1."""
    name = "io.max" if h.version == 2 else "blkio.throttle.write_bps_device"
    return Path(h.file(cgroup, name)).read_text().splitlines()


def test_a_real_io_cgroup_favoured_with_what_the_kernel_offers_and_put_back(tmp_path):
    """Weights where BFQ or io.cost schedules a disk; where not (mq-deadline, none: this VM, NVMe
    hosts), the best-effort cgroup's writes capped instead, which a direct writer feels; skipped
    only where neither can be had."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    try:
        h = IoHierarchy.find()
    except CgroupError as exc:
        pytest.skip(f"no io controller: {exc}")
    dev = os.stat(tmp_path).st_dev
    try:
        disk = block_devices.resolve(f"{os.major(dev)}:{os.minor(dev)}")
    except block_devices.DeviceError:
        pytest.skip(f"{tmp_path} is on no block device (tmpfs?): nothing to weigh or cap")
    tag = uuid.uuid4().hex[:8]
    worker, batch = f"/tn-test-{tag}-worker", f"/tn-test-{tag}-batch"
    made = []
    try:
        for cg in (worker, batch):
            h.create(cg)
            made.append(cg)
        cfg = LeversConfig(
            worker_cgroup=worker,
            best_effort_cgroups=[batch],
            io_throttle_devices=[disk],
            best_effort_write_bps=4 << 20,
            best_effort_write_iops=0,
        )
        _, policy = node_io_policy(cfg)
        if policy.mode == OFF:
            pytest.skip(f"neither io weights nor write limits on this host: {policy.summary()}")
        weights = [Path(p) for cg in (worker, batch) for p, _ in h.weight_writes(cg, 100)] if policy.weighted else []
        before = [f.read_text().strip() for f in weights], throttle_lines(h, batch)
        journal = KnobJournal(str(tmp_path / "levers.json"))
        throttle = IoThrottle(cfg, KnobWrites(journal))
        workers = [WorkerCgroup("default", worker, lambda: 1)]
        lever = IoWeight(cfg, KnobWrites(journal), workers, "/proc", throttle)
        detail = lever.engage()
        assert detail["worker_cgroups"] == {"default": worker} and detail["io_policy"]["mode"] == policy.mode
        if policy.weighted:
            assert [f.read_text().split()[-1] for f in weights] == ["1000", "1"]
        else:  # capped instead: a direct writer in the batch cgroup waits for it
            assert detail["capped_devices"] == [disk]
            assert [line for line in throttle_lines(h, batch) if line.startswith(f"{disk} ")]
            assert not [line for line in throttle_lines(h, worker) if line.startswith(f"{disk} ")]
            dd = f"dd if=/dev/zero of={tmp_path / 'f'} bs=1M count=8 oflag=direct status=none"
            t0 = time.monotonic()
            subprocess.run(["sh", "-c", f"echo $$ > {h.procs_file(batch)} && exec {dd}"], check=True, timeout=30)
            assert time.monotonic() - t0 >= 1.0  # 8 MiB at 4 MiB/s; unthrottled, a few ms
        assert lever.release() == [] and not journal.entries
        assert ([f.read_text().strip() for f in weights], throttle_lines(h, batch)) == before
    finally:
        for cg in reversed(made):
            h.remove(cg)


def test_the_levels_recovery_does_not_wait_for_the_memory_rules_calm():
    """The memory rules' 30 s of calm holds their levers, not the level another rule raised."""
    p = policy_from_config(PolicyConfig())
    d = feed(p, [{"cpu_load": 0.9, "worker_major_faults_per_s": 480.0}] * 10)
    assert d[-1].level_name == "pressured" and levers(d[-1]) >= MEMORY_LEVERS
    d = feed(p, [{"cpu_load": 0.0, "worker_major_faults_per_s": 0.0}] * 100, start=1.0)  # 10 s
    assert d[-1].level_name == "normal" and levers(d[-1]) == MEMORY_LEVERS
