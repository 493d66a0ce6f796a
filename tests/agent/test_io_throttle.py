"""The io_throttle lever (agent/levers/io.py): best-effort cgroups' writes capped per disk.

On fake trees: the disks a configuration names or the mounts lie on (turbonode/block_devices.py),
the v1 and v2 files and what a missing capability or a bad key says, per-device lines in the
journal. For real on this host's cgroup v1 (blkio): the cap engaged and undone, a writer with an
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
from agent.levers.io import IoThrottle
from agent.levers.journal import KnobJournal, KnobWrites
from tests.agent.helpers import real_v1
from tests.helpers import ROOT, kill_9_once
from turbonode import block_devices
from turbonode.block_devices import DeviceError
from turbonode.cgroups import CgroupError
from turbonode.config import ConfigError, LeversConfig, load_config
from turbonode.memory_cgroups import V2_NO_LIMIT, IoHierarchy

MIB = 1 << 20
BPS_V1 = "blkio.throttle.write_bps_device"
IOPS_V1 = "blkio.throttle.write_iops_device"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(tmp_path: Path) -> Path:
    """vda (254:0) with a partition vda1 (254:1), and nvme0n1 (259:0), as sysfs links them."""
    sys_ = tmp_path / "sys"
    for disk, dev, parts in (("vda", "254:0", {"vda1": "254:1"}), ("nvme0n1", "259:0", {})):
        d = sys_ / "devices/virtual/block" / disk
        write(d / "dev", dev + "\n")
        links = {disk: (d, dev)}
        for part, pdev in parts.items():
            write(d / part / "dev", pdev + "\n")
            write(d / part / "partition", "1\n")
            links[part] = (d / part, pdev)
        for name, (target, majmin) in links.items():
            (sys_ / "class/block").mkdir(parents=True, exist_ok=True)
            (sys_ / "dev/block").mkdir(parents=True, exist_ok=True)
            (sys_ / "class/block" / name).symlink_to(target)
            (sys_ / "dev/block" / majmin).symlink_to(target)
    return sys_


def fake_procfs(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    write(
        proc / "self/mountinfo",
        "22 1 254:1 / / rw,relatime - ext4 /dev/vda1 rw\n"
        "23 22 0:21 / /proc rw - proc proc rw\n"
        "24 22 254:1 /srv /srv rw - ext4 /dev/vda1 rw\n"  # a bind mount of the same disk: once
        "25 22 259:0 / /data rw - xfs /dev/nvme0n1 rw\n"
        "26 22 7:0 / /snap/x ro - squashfs /dev/loop0 ro\n",  # not in this sysfs: left out
    )
    return proc


def fake_blkio(tmp_path: Path, files: tuple[str, ...] = (BPS_V1, IOPS_V1)) -> Path:
    root = tmp_path / "cgroup"
    write(root / "blkio/blkio.reset_stats", "")
    (root / "blkio/batch").mkdir(parents=True)
    for name in files:
        write(root / "blkio/batch" / name, "")
    (root / "unified").mkdir()
    write(root / "unified/cgroup.controllers", "\n")
    return root


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
