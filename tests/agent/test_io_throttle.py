"""The io_throttle lever (agent/levers/io.py): best-effort cgroups' writes capped per disk, and
io_weight where the disks have no proportional io policy (agent/levers/io_policy.py).

On fake trees: the disks a configuration names or the mounts lie on (turbonode/block_devices.py),
the v1 and v2 files and what a missing capability or a bad key says, per-device lines in the
journal; io_weight weighing the disks BFQ or io.cost schedules, capping the writes on the others
through io_throttle's writer (both levers' caps kept apart), or staying off and saying so in
status and the metric. For real on this host's cgroup v1 (blkio): the cap engaged and undone, a writer with an
fsync per MiB in the capped cgroup held to it, and what a killed agent left restored by the next.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agent.levers import Levers
from agent.levers.cgroup import WorkerCgroup
from agent.levers.io import IoThrottle, IoWeight, NoIoControl
from agent.levers.journal import KnobJournal, KnobWrites
from agent.metrics import LeverModeCollector
from tests.agent.helpers import BPS_V1, IOPS_V1, fake_blkio, fake_procfs, fake_sysfs, real_v1, write
from tests.helpers import ROOT, kill_9_once
from turboctl.status_cmd import _lever
from turbonode import block_devices
from turbonode.block_devices import DeviceError
from turbonode.cgroups import CgroupError
from turbonode.config import ConfigError, LeversConfig, load_config
from turbonode.memory_cgroups import V2_NO_LIMIT, IoHierarchy

MIB = 1 << 20


def test_the_disks_named_or_under_the_mounts(tmp_path):
    sysfs, proc = fake_sysfs(tmp_path), fake_procfs(tmp_path)
    assert block_devices.mounted_disks(str(proc), str(sysfs)) == ["254:0", "259:0"]
    for spec in ("vda", "/dev/vda", "vda1", "254:1", "254:0"):
        assert block_devices.resolve(spec, str(sysfs)) == "254:0"  # a partition stands for its disk
    with pytest.raises(DeviceError, match="no block device 'sdz'"):
        block_devices.resolve("sdz", str(sysfs))
    with pytest.raises(DeviceError, match="no block device 8:0"):
        block_devices.resolve("8:0", str(sysfs))


def test_the_lever_caps_each_best_effort_cgroup_per_disk_on_v1_and_undoes_it(tmp_path):
    root, sysfs, proc = fake_blkio(tmp_path), fake_sysfs(tmp_path), fake_procfs(tmp_path)
    cfg = LeversConfig(
        cgroup_root=str(root), best_effort_cgroups=["/batch"], best_effort_write_bps=8 * MIB, best_effort_write_iops=0
    )
    journal = KnobJournal(str(tmp_path / "s.json"))
    lever = IoThrottle(cfg, KnobWrites(journal), str(proc), str(sysfs))
    detail = lever.engage()
    assert detail["devices"] == ["254:0", "259:0"] and detail["write_bps"] == 8 * MIB
    bps = root / "blkio/batch" / BPS_V1
    # a plain file keeps the last write; each device is a knob of its own in the journal
    assert bps.read_text() == f"259:0 {8 * MIB}" and len(journal.entries) == 2
    assert (root / "blkio/batch" / IOPS_V1).read_text() == ""  # 0: not capped
    assert lever.release() == [] and not journal.entries
    assert bps.read_text() == "259:0 0"  # the last undone (newest first); the kernel removes a line on 0


def test_v2_writes_io_max_lines_and_a_missing_file_is_named(tmp_path):
    root = tmp_path / "cgroup2"
    write(root / "cgroup.controllers", "cpu io memory\n")
    write(root / "batch.slice/io.max", "")
    h = IoHierarchy.find(str(root))
    assert h.throttle_writes("batch.slice", ["254:0"], 4 * MIB, 0) == [
        (str(root / "batch.slice/io.max"), f"wbps={4 * MIB} wiops=max", "254:0", V2_NO_LIMIT)
    ]
    (root / "job.slice").mkdir()
    with pytest.raises(CgroupError, match="job.slice has no io.max.*io controller is not enabled"):
        h.throttle_writes("job.slice", ["254:0"], 4 * MIB, 0)
    v1 = IoHierarchy.find(str(fake_blkio(tmp_path, files=())))
    with pytest.raises(CgroupError, match="no blkio.throttle.write_bps_device.*CONFIG_BLK_DEV_THROTTLING"):
        v1.throttle_writes("/batch", ["254:0"], 4 * MIB, 0)


def test_what_cannot_be_capped_is_named_and_nothing_is_left_half_done(tmp_path):
    root, sysfs, proc = fake_blkio(tmp_path), fake_sysfs(tmp_path), fake_procfs(tmp_path)
    journal = KnobJournal(str(tmp_path / "s.json"))

    def engage(**kw) -> None:
        cfg = LeversConfig(cgroup_root=str(root), **{"best_effort_cgroups": ["/batch"], **kw})
        IoThrottle(cfg, KnobWrites(journal), str(proc), str(sysfs)).engage()

    with pytest.raises(CgroupError, match="levers.best_effort_cgroups"):
        engage(best_effort_cgroups=[])
    with pytest.raises(CgroupError, match="best_effort_write_bps and best_effort_write_iops are both 0"):
        engage(best_effort_write_bps=0, best_effort_write_iops=0)
    with pytest.raises(DeviceError, match="no block device 'sdz'"):
        engage(io_throttle_devices=["vda", "sdz"])
    with pytest.raises(CgroupError, match="cgroup /gone does not exist"):
        engage(best_effort_cgroups=["/batch", "/gone"])
    assert not journal.entries and (root / "blkio/batch" / BPS_V1).read_text() == "259:0 0"  # /batch undone


# ---- io_weight where the disks have no proportional io policy --------------------------------------


def weigh_tree(tmp_path: Path, bfq: bool, throttle: bool = True) -> Path:
    """fake_blkio with a /worker cgroup beside /batch; with BFQ's weight files where `bfq`."""
    root = fake_blkio(tmp_path, files=(BPS_V1, IOPS_V1) if throttle else ())
    (root / "blkio/worker").mkdir()
    if bfq:
        for d in ("", "worker", "batch"):
            write(root / "blkio" / d / "blkio.bfq.weight", "100\n")
    return root


def io_levers(tmp_path: Path, root: Path, sysfs: Path, proc: Path) -> tuple[KnobJournal, IoThrottle, IoWeight]:
    """Both io levers on one journal, io_weight capping through io_throttle's writer, as the agent has them."""
    cfg = LeversConfig(
        cgroup_root=str(root), worker_cgroup="/worker", best_effort_cgroups=["/batch"], best_effort_write_iops=0
    )
    journal = KnobJournal(str(tmp_path / "s.json"))
    throttle = IoThrottle(cfg, KnobWrites(journal), str(proc), str(sysfs))
    workers = [WorkerCgroup("default", "/worker", lambda: 1)]
    return journal, throttle, IoWeight(cfg, KnobWrites(journal), workers, str(proc), throttle, str(sysfs))


def test_without_a_proportional_io_policy_io_weight_caps_the_writes_instead(tmp_path):
    """mq-deadline and none, v1 without BFQ: no weight file at all. It was a CgroupError at every
    sample ('no blkio.bfq.weight or blkio.weight'); now the lever does what the kernel offers."""
    root, sysfs, proc = weigh_tree(tmp_path, bfq=False), fake_sysfs(tmp_path), fake_procfs(tmp_path)
    journal, _, lever = io_levers(tmp_path, root, sysfs, proc)
    detail = lever.engage()
    policy = detail["io_policy"]
    assert policy["mode"] == "throttle" and detail["capped_devices"] == ["254:0", "259:0"]
    assert policy["unweighted"] == {"254:0": "scheduler mq-deadline", "259:0": "scheduler none"}
    assert "no proportional io policy on 254:0 (scheduler mq-deadline)" in policy["summary"]
    assert (root / "blkio/batch" / BPS_V1).read_text() == f"259:0 {32 * MIB}"
    assert sorted(journal.entries) == [f"{root}/blkio/batch/{BPS_V1} {d}" for d in ("254:0", "259:0")]
    assert not list((root / "blkio/worker").iterdir())  # nothing to write for the worker
    assert lever.release() == [] and not journal.entries


def test_weights_where_bfq_schedules_a_disk_and_caps_on_the_others(tmp_path):
    root = weigh_tree(tmp_path, bfq=True)
    sysfs, proc = fake_sysfs(tmp_path, vda="mq-deadline [bfq] none"), fake_procfs(tmp_path)
    journal, throttle, lever = io_levers(tmp_path, root, sysfs, proc)
    detail = lever.engage()
    assert detail["io_policy"]["mode"] == "weight+throttle" and detail["io_policy"]["weighted"] == {"254:0": "bfq"}
    assert [(root / "blkio" / cg / "blkio.bfq.weight").read_text() for cg in ("worker", "batch")] == ["1000", "1"]
    assert detail["capped_devices"] == ["259:0"] and throttle.holds == {"io_weight": ("259:0",)}
    # io_throttle engaged too caps both disks; its release leaves io_weight's cap on 259:0
    assert throttle.engage()["devices"] == ["254:0", "259:0"]
    bps = f"{root}/blkio/batch/{BPS_V1}"
    assert {f"{bps} 254:0", f"{bps} 259:0"} <= set(journal.entries)
    assert throttle.release() == [] and f"{bps} 259:0" in journal.entries and f"{bps} 254:0" not in journal.entries
    assert lever.release() == [] and not journal.entries
    assert [(root / "blkio" / cg / "blkio.bfq.weight").read_text() for cg in ("worker", "batch")] == ["100"] * 2


def test_io_cost_weighs_a_disk_on_v2_whatever_its_scheduler(tmp_path):
    root, sysfs, proc = tmp_path / "cgroup2", fake_sysfs(tmp_path), fake_procfs(tmp_path)
    write(root / "cgroup.controllers", "cpu io memory\n")
    write(root / "io.cost.qos", "254:0 enable=1 ctrl=auto rpct=0.00 rlat=250000 wpct=0.00 wlat=250000\n")
    for cg in ("worker", "batch"):
        write(root / cg / "io.weight", "default 100\n")
        write(root / cg / "io.max", "")
    journal, _, lever = io_levers(tmp_path, root, sysfs, proc)
    detail = lever.engage()
    assert detail["io_policy"]["weighted"] == {"254:0": "io.cost"}
    assert detail["io_policy"]["unweighted"] == {"259:0": "scheduler none, io.cost off"}
    assert (root / "worker/io.weight").read_text() == "default 1000"
    assert (root / "batch/io.max").read_text() == f"259:0 wbps={32 * MIB} wiops=max"
    assert lever.release() == [] and not journal.entries


def test_neither_weights_nor_write_limits_leave_it_off_saying_why(tmp_path):
    root = weigh_tree(tmp_path, bfq=False, throttle=False)
    sysfs, proc = fake_sysfs(tmp_path), fake_procfs(tmp_path)
    journal, _, lever = io_levers(tmp_path, root, sysfs, proc)
    with pytest.raises(NoIoControl, match=r"stays off: no proportional io policy on 254:0 \(scheduler mq-deadline\)"):
        lever.engage()
    assert not journal.entries
    # in the agent: reported (status, the metric), retried, never fatal
    cfg = LeversConfig(cgroup_root=str(root), best_effort_cgroups=["/batch"], oom_guard=False)
    levers = Levers(cfg, str(tmp_path / "l.json"), [], str(proc), sysfs=str(sysfs))
    assert levers.reconcile({"io_weight": "psi_io_some=0.6 > 0.3"}, {}, "recovery") == []
    st = levers.status()["io_weight"]
    assert not st["engaged"] and "no blkio.throttle.write_bps_device" in st["error"]
    assert st["io_policy"]["mode"] == "off"
    assert _lever("io_weight", st).startswith("io_weight off: stays off: no proportional io policy")
    [family] = LeverModeCollector(levers.modes).collect()
    assert {s.labels["mode"]: s.value for s in family.samples if s.labels["lever"] == "io_weight"} == {
        "weight": 0.0,
        "weight+throttle": 0.0,
        "throttle": 0.0,
        "off": 1.0,
    }
    assert family.name == "turbonode_lever_mode"


def test_status_says_what_io_weight_does_instead():
    policy = {"mode": "throttle", "summary": "no proportional io policy on 254:0 (scheduler none): capped"}
    engaged = {"engaged": True, "reason": "psi_io_some=0.6 > 0.3", "io_policy": policy}
    assert _lever("io_weight", engaged) == (
        "io_weight engaged (psi_io_some=0.6 > 0.3) [throttle: no proportional io policy on 254:0 (scheduler none): "
        "capped]"
    )
    assert _lever("io_weight", {"engaged": False, "io_policy": policy}).startswith("io_weight off [throttle: ")
    assert _lever("io_weight", {"engaged": False, "io_policy": {"mode": "weight", "summary": "x"}}) == "io_weight off"


def test_a_bad_device_or_limit_in_the_config_names_the_key(tmp_path):
    for text, key in (
        ('io_throttle_devices = ["sda 1"]', "levers.io_throttle_devices"),
        ("best_effort_write_bps = -1", "levers.best_effort_write_bps"),
        ('[policy.rules.psi_io_some]\nlevers = ["io_trottle"]', "psi_io_some.levers"),
    ):
        f = tmp_path / "t.toml"
        f.write_text(text if text.startswith("[") else f"[levers]\n{text}\n")
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(str(f), env={})


# ---- for real, on this host's blkio (cgroup v1) ----------------------------------------------


@pytest.fixture
def batch_blkio(tmp_path):
    """A blkio cgroup of our own on v1 and the disk under the test's directory; removed after."""
    h = real_v1(IoHierarchy, "the fake trees above")
    cg = f"/tn-test-{uuid.uuid4().hex[:8]}-batch"
    h.create(cg)
    try:
        dev = os.stat(tmp_path).st_dev
        yield h, cg, block_devices.resolve(f"{os.major(dev)}:{os.minor(dev)}")
    finally:
        h.remove(cg)


def test_a_writer_with_fsyncs_is_held_to_the_cap_and_released(batch_blkio, tmp_path):
    h, cg, disk = batch_blkio
    bps = Path(h.file(cg, BPS_V1))
    cfg = LeversConfig(best_effort_cgroups=[cg], best_effort_write_bps=4 * MIB, best_effort_write_iops=0)
    lever = IoThrottle(cfg, KnobWrites(KnobJournal(str(tmp_path / "s.json"))))
    assert disk in lever.engage()["devices"]
    assert f"{disk} {4 * MIB}" in bps.read_text().splitlines()
    # sandbox/pressure.py's writer (the node SLO io cell's), 2 s in the capped cgroup: unthrottled
    # it writes hundreds of MiB a second here; its fsyncs' writeback is charged to it on v1
    writer = [sys.executable, "-m", "sandbox.pressure", "write", "--dir", str(tmp_path), "--size-mb", "32"]
    moved = f"echo $$ > {h.procs_file(cg)} && exec " + " ".join([*writer, "--seconds", "2"])
    t0 = time.monotonic()
    subprocess.run(["sh", "-c", moved], cwd=ROOT, check=True, capture_output=True, timeout=30)
    took = time.monotonic() - t0
    written = sum(
        int(line.split()[2])
        for line in Path(h.file(cg, "blkio.throttle.io_service_bytes")).read_text().splitlines()
        if line.startswith(disk) and line.split()[1] == "Write"
    )
    assert 0 < written <= 4 * MIB * (took + 1), f"{written / MIB:.1f} MiB in {took:.1f} s"
    assert lever.release() == []
    assert not [line for line in bps.read_text().splitlines() if line.startswith(f"{disk} ")]


def test_what_a_killed_agent_capped_is_restored_by_the_next(batch_blkio, tmp_path):
    h, cg, disk = batch_blkio
    state = tmp_path / "levers.json"
    files = [Path(h.file(cg, name)) for name in (BPS_V1, IOPS_V1)]
    agent = textwrap.dedent(f"""
        from agent.levers import Levers
        from turbonode.config import LeversConfig
        cfg = LeversConfig(best_effort_cgroups=[{cg!r}], io_throttle_devices=[{disk!r}], oom_guard=False)
        levers = Levers(cfg, {str(state)!r}, [])
        levers.reconcile({{"io_throttle": "psi_io_some=0.6 > 0.3"}}, {{}}, "recovery")
        assert levers.status()["io_throttle"]["engaged"], levers.status()
        print("engaged", flush=True)
        import time; time.sleep(60)
    """)
    kill_9_once(agent)
    cfg = LeversConfig()
    assert [f.read_text().split() for f in files] == [
        [disk, str(cfg.best_effort_write_bps)],
        [disk, str(cfg.best_effort_write_iops)],
    ]
    levers = Levers(LeversConfig(oom_guard=False), str(state), [])
    assert levers.restore_leftovers() == []  # what the next agent does first
    assert [f.read_text() for f in files] == ["", ""] and not state.exists()


def test_what_a_cgroup_wrote_per_version(tmp_path):
    """bench/node_slo.py reports the batch cgroup's writes per cell from these counters."""
    v1 = IoHierarchy.find(str(fake_blkio(tmp_path)))
    write(
        Path(v1.dir("/batch")) / "blkio.throttle.io_service_bytes_recursive",
        "254:0 Read 10\n254:0 Write 300\n254:0 Total 310\n259:0 Write 5\nTotal 315\n",
    )
    assert v1.written_bytes("/batch") == 305
    root = tmp_path / "cgroup2"
    write(root / "cgroup.controllers", "io\n")
    write(root / "batch.slice/io.stat", "254:0 rbytes=7 wbytes=1000 rios=1 wios=2\n259:0 rbytes=0 wbytes=24\n")
    assert IoHierarchy.find(str(root)).written_bytes("batch.slice") == 1024
