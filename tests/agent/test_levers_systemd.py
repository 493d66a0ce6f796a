"""The levers where systemd owns the cgroup tree (agent/levers/writers.py, unit_properties.py).

Beside a fake systemd (FakeBus: the properties SetUnitProperties would set): which knobs become
which unit properties, the real levers engaged and released through the systemd writer on a fake
v2 tree whose unit cgroups' files stay untouched, a delegated subtree written raw, a knob with
no property refused, and what a killed agent set put back by the next.

For real, under systemd 252 booted in a container (tests/deploy/helpers.py): the D-Bus calls
reach it, `systemctl show` sees the properties change, a `systemctl daemon-reload` keeps them,
and they are put back on release and by the next agent after a kill -9. The container's v1
controllers are read-only on this hybrid host, so what the kernel then does with them is left
to a systemd host with cgroup v2: test_levers_on_this_systemd_host runs there (the Debian 12 VM
of scripts/host_vm.sh) and skips elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from agent.levers import Levers
from agent.levers.cgroup import WorkerCgroup
from agent.levers.journal import KnobError, KnobJournal
from agent.levers.unit_properties import UINT64_MAX, to_property
from agent.levers.writers import CgroupfsWriter, SystemdWriter, choose_writer, unit_of_cgroup
from tests.helpers import kill_9_once
from turboctl.status_cmd import _levers
from turbonode import block_devices
from turbonode.config import LeversConfig


class FakeBus:
    """systemd's properties as SetUnitProperties leaves them (unset: UINT64_MAX, lists empty)."""

    def __init__(self) -> None:
        self.props: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, list]] = []

    def set_properties(self, unit: str, properties: list) -> None:
        self.calls.append((unit, properties))
        mine = self.props.setdefault(unit, {})
        for name, (sig, value) in properties:
            if sig == "a(st)":  # a device's entry replaced, the others kept, as systemd does
                kept = [e for e in mine.get(name, []) if e[0] not in {p for p, _ in value}]
                mine[name] = kept + list(value)
            else:
                mine[name] = value

    def get_property(self, unit: str, name: str) -> Any:
        default: Any = [] if name.startswith("IOWrite") else UINT64_MAX
        return self.props.get(unit, {}).get(name, default)

    def close(self) -> None:
        pass


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_v2(tmp_path: Path) -> Path:
    """A v2 host under systemd: the worker's service, a batch slice, a delegated subtree."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu io memory\n")
    for cg in ("system.slice/turbonode-worker@a.service", "batch.slice", "ci.service/job"):
        write(root / cg / "cpu.weight", "100\n")
        write(root / cg / "cpu.max", "max 100000\n")
        write(root / cg / "memory.high", "max\n")
        write(root / cg / "memory.current", "1048576\n")
        write(root / cg / "io.weight", "default 100\n")
        write(root / cg / "io.max", "")
    return root


def test_knobs_map_to_unit_properties():
    assert to_property("cpu.weight", "10000") == ("CPUWeight", "10000")
    assert to_property("cpu.shares", "102400") == ("CPUWeight", "10000")  # v1, the lever's conversion undone
    assert to_property("cpu.shares", "10") == ("CPUWeight", "1")
    assert to_property("cpu.max", "50000 100000") == ("CPUQuotaPerSecUSec", "500000")
    assert to_property("cpu.max", "max 100000") == ("CPUQuotaPerSecUSec", "infinity")
    assert to_property("cpu.cfs_quota_us", "-1") == ("CPUQuotaPerSecUSec", "infinity")
    assert to_property("memory.high", "4194304") == ("MemoryHigh", "4194304")
    assert to_property("memory.min", "max") == ("MemoryMin", "infinity")
    assert to_property("io.weight", "default 1000") == ("IOWeight", "1000")
    assert to_property("io.max", "wbps=33554432 wiops=max") == ("IOWriteMax", "wbps=33554432 wiops=max")
    assert to_property("io.bfq.weight", "default 1000") is None  # systemd writes it from IOWeight
    assert unit_of_cgroup("/system.slice/turbonode-worker@a.service") == ("turbonode-worker@a.service", False)
    assert unit_of_cgroup("/ci.service/job") == (None, True)  # below a unit: delegated or hand-made
    assert unit_of_cgroup("/tn-test-x/worker") == (None, False)


def test_levers_go_through_the_units_properties_and_come_back(tmp_path):
    root, bus = fake_v2(tmp_path), FakeBus()
    cfg = LeversConfig(
        cgroup_root=str(root),
        best_effort_cgroups=["batch.slice", "/ci.service/job"],
        best_effort_cpus=0.5,
        best_effort_write_iops=0,
        io_throttle_devices=["254:0"],
        oom_guard=False,
    )
    worker = "/system.slice/turbonode-worker@a.service"
    workers = [WorkerCgroup("a", worker, lambda: None)]
    state = tmp_path / "levers.json"
    sysfs = tmp_path / "sys"
    write(sysfs / "dev/block/254:0/queue/scheduler", "[none] mq-deadline\n")
    writer = SystemdWriter(bus, str(root), "PID 1 is systemd (fake)")  # type: ignore[arg-type]
    levers = Levers(cfg, str(state), workers, str(tmp_path), sysfs=str(sysfs), writer=writer)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    before = {p: p.read_text() for p in files}
    levers.reconcile({"cpu_share": "cpu_load=0.9 > 0.35", "io_throttle": "psi_io_some=0.6 > 0.3"}, {}, "recovery")
    st = levers.status()
    assert st["cpu_share"]["engaged"] and st["io_throttle"]["engaged"], st
    assert bus.props["turbonode-worker@a.service"] == {"CPUWeight": 10000}
    assert bus.props["batch.slice"] == {
        "CPUWeight": 1,
        "CPUQuotaPerSecUSec": 500000,
        "IOWriteBandwidthMax": [("/dev/block/254:0", 33554432)],
        "IOWriteIOPSMax": [("/dev/block/254:0", UINT64_MAX)],
    }
    # the units' cgroup files are systemd's: untouched; the delegated subtree's are written
    changed = {p for p in files if p.read_text() != before[p]}
    assert changed == {root / "ci.service/job" / f for f in ("cpu.weight", "cpu.max", "io.max")}
    assert "systemd:batch.slice:CPUWeight" in st["changed"]
    assert st["writer"]["backend"] == "systemd" and st["writer"]["workers"]["a"]["through"] == "not known yet (no pid)"
    assert _levers(st)[-1].startswith("writer:   systemd (PID 1 is systemd (fake)); worker a: cgroup None")
    levers.reconcile({}, {}, "recovery")
    assert bus.props["turbonode-worker@a.service"] == {"CPUWeight": UINT64_MAX}  # unset again
    assert bus.props["batch.slice"]["IOWriteBandwidthMax"] == [("/dev/block/254:0", UINT64_MAX)]
    delegated_io = root / "ci.service/job/io.max"  # a plain file keeps the no-limit line the kernel drops
    assert delegated_io.read_text() == "254:0 rbps=max wbps=max riops=max wiops=max"
    after = {p: p.read_text().strip() for p in files if p != delegated_io}
    assert after == {p: t.strip() for p, t in before.items() if p != delegated_io} and not state.exists()


def test_a_stock_v2_host_gets_the_io_cap_from_systemd(tmp_path):
    """On a stock systemd v2 host no unit asked for the io controller, so batch.slice has no
    io.max: the systemd writer still caps it (IOWriteBandwidthMax= makes systemd enable the
    controller, as the Debian 12 VM of scripts/host_vm.sh showed); the files' writer refuses,
    naming why, and io_weight's fallback says the same."""
    root = fake_v2(tmp_path)
    (root / "batch.slice/io.max").unlink()
    sysfs = tmp_path / "sys"
    write(sysfs / "dev/block/254:0/queue/scheduler", "[none] mq-deadline\n")
    cfg = LeversConfig(
        cgroup_root=str(root), best_effort_cgroups=["batch.slice"], io_throttle_devices=["254:0"], oom_guard=False
    )
    bus = FakeBus()
    writer = SystemdWriter(bus, str(root))  # type: ignore[arg-type]
    systemd = Levers(cfg, str(tmp_path / "a.json"), [], str(tmp_path), sysfs=str(sysfs), writer=writer)
    systemd.reconcile({"io_weight": "psi_io_some=0.6 > 0.3"}, {}, "recovery")
    st = systemd.status()
    assert st["io_weight"]["engaged"] and st["io_weight"]["io_policy"]["mode"] == "throttle", st["io_weight"]
    assert bus.props["batch.slice"]["IOWriteBandwidthMax"] == [("/dev/block/254:0", 33554432)]
    systemd.reconcile({}, {}, "recovery")
    files = Levers(
        cfg, str(tmp_path / "b.json"), [], str(tmp_path), sysfs=str(sysfs), writer=CgroupfsWriter("no systemd")
    )
    files.reconcile({"io_weight": "psi_io_some=0.6 > 0.3"}, {}, "recovery")
    st = files.status()
    assert not st["io_weight"]["engaged"]
    why = "batch.slice has no io.max: no io write limits (the io controller is not enabled for it)"
    assert why in st["io_weight"]["error"]


def test_a_killed_agents_unit_properties_are_put_back_by_the_next(tmp_path):
    root, bus = fake_v2(tmp_path), FakeBus()
    bus.props["batch.slice"] = {"CPUWeight": 50}  # the unit's own setting, from its file
    state = str(tmp_path / "levers.json")
    journal = KnobJournal(state, SystemdWriter(bus, str(root)))  # type: ignore[arg-type]
    journal.set(str(root / "batch.slice/cpu.weight"), "1")
    journal.set(str(root / "batch.slice/memory.high"), "8388608")
    assert bus.props["batch.slice"] == {"CPUWeight": 1, "MemoryHigh": 8388608}
    # killed here (no undo); the next agent restores what the state file lists
    assert KnobJournal(state, SystemdWriter(bus, str(root))).restore_leftovers() == []  # type: ignore[arg-type]
    assert bus.props["batch.slice"] == {"CPUWeight": 50, "MemoryHigh": UINT64_MAX} and not os.path.exists(state)
    # a host without systemd cannot put a unit property back: it says so
    KnobJournal(state, SystemdWriter(bus, str(root))).set(str(root / "batch.slice/cpu.weight"), "1")  # type: ignore[arg-type]
    problems = KnobJournal(state, CgroupfsWriter("no systemd")).restore_leftovers()
    assert problems == [
        "cannot read CPUWeight of batch.slice: systemd:batch.slice:CPUWeight is a unit property, and systemd "
        "is not PID 1 here to ask"
    ]


def test_a_knob_without_a_property_is_refused_not_written(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory/system.slice/x.service/memory.oom_control", "oom_kill_disable 0\n")
    write(root / "memory/memory.limit_in_bytes", "0\n")  # a v1 mount: no cgroup.controllers at the root
    journal = KnobJournal(str(tmp_path / "s.json"), SystemdWriter(FakeBus(), str(root)))  # type: ignore[arg-type]
    with pytest.raises(KnobError, match="systemd owns x.service, and its memory.oom_control has no unit property"):
        journal.set(str(root / "memory/system.slice/x.service/memory.oom_control"), "1", "oom_kill_disable")
    assert not journal.entries


def test_the_writer_is_chosen_by_pid_1(tmp_path):
    write(tmp_path / "1/comm", "bash\n")
    assert choose_writer(str(tmp_path), booted=str(tmp_path / "none")).backend == "cgroupfs"
    write(tmp_path / "1/comm", "systemd\n")
    assert choose_writer(str(tmp_path), booted=str(tmp_path / "none")).backend == "cgroupfs"  # not sd_booted
    (tmp_path / "booted").mkdir()
    assert choose_writer(str(tmp_path), booted=str(tmp_path / "booted")).backend == "systemd"
    assert choose_writer().backend == (
        "systemd" if Path("/proc/1/comm").read_text().strip() == "systemd" else "cgroupfs"
    )


# ---- for real: systemd 252 in a container ---------------------------------------------------------

WORKER_UNIT, BATCH_SLICE = "tn-lever-worker.service", "tn-lever-batch.slice"
SHOWN = ("CPUWeight", "CPUQuotaPerSecUSec", "MemoryHigh", "IOWeight", "IOWriteBandwidthMax")
# what a lever computes for each unit's cgroup, as (knob file, value, device): cpu_share, memory_squeeze,
# io_weight and io_throttle on cgroup v2
KNOBS = {
    WORKER_UNIT: [("cpu.weight", "10000", None), ("io.weight", "default 1000", None)],
    BATCH_SLICE: [
        ("cpu.weight", "1", None),
        ("cpu.max", "50000 100000", None),
        ("memory.high", "67108864", None),
        ("io.weight", "default 1", None),
        ("io.max", "wbps=33554432 wiops=max", "DISK"),
    ],
}
AGENT = """
import json, os, sys
from agent.levers.journal import KnobJournal
from agent.levers.writers import choose_writer
mode, state, root, knobs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
writer = choose_writer(cgroup_root=root)
assert writer.backend == "systemd", writer.why
journal = KnobJournal(state, writer)
if mode == "restore":
    print(json.dumps(journal.restore_leftovers()), flush=True)
    sys.exit()
for cgroup, writes in knobs.items():
    for knob, value, device in writes:
        absent = None if device is None else "rbps=max wbps=max riops=max wiops=max"
        journal.set(os.path.join(root, cgroup, knob), value, device, absent=absent)
print("engaged", os.getpid(), flush=True)
sys.stdin.readline()
print(json.dumps(journal.undo_all()), flush=True)
"""


@pytest.fixture(scope="module")
def systemd(tmp_path_factory):
    from sandbox.netns import Sandbox
    from tests.deploy.helpers import Container, skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(f"cannot boot a systemd container here: {reason}")
    console = tmp_path_factory.mktemp("systemd") / "console.log"
    with Sandbox() as sb:
        box = Container(sb.server, console)
        box.boot()
        try:
            box.run("systemd-run", f"--unit={WORKER_UNIT}", "sleep", "3600")
            box.run("systemd-run", f"--slice={BATCH_SLICE}", "--unit=tn-lever-job.service", "sleep", "3600")
            yield box
        finally:
            box.run("systemctl", "stop", WORKER_UNIT, "tn-lever-job.service", check=False)
            box.close()


def shown(box) -> dict[str, dict[str, str]]:
    out = {}
    for unit in (WORKER_UNIT, BATCH_SLICE):
        text = box.run("systemctl", "show", unit, *(f"--property={p}" for p in SHOWN)).stdout
        out[unit] = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return out


@pytest.mark.root
@pytest.mark.slow
def test_unit_properties_under_a_real_systemd(systemd, tmp_path):
    """Through D-Bus to systemd 252 (its private socket, as root): set, kept across daemon-reload,
    put back on release; set again, the agent killed -9, put back by the next one."""
    box = systemd
    disks = block_devices.mounted_disks() or ["254:0"]
    knobs = {
        ("system.slice/" if unit == WORKER_UNIT else "") + unit: [(k, v, disks[0] if d else None) for k, v, d in w]
        for unit, w in KNOBS.items()
    }
    root = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    state = f"/run/tn-levers-{uuid.uuid4().hex[:8]}.json"
    python = "/opt/turbonode/.venv/bin/python"
    argv = [python, "-c", AGENT, "engage", state, root, json.dumps(knobs)]
    before = shown(box)
    seen: dict[str, Any] = {"before": before}

    def start() -> tuple[subprocess.Popen, str]:
        agent = box.popen(
            "sh",
            "-c",
            'cd /opt/turbonode && exec "$@"',
            "agent",
            *argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert agent.stdout is not None
        line = agent.stdout.readline().split()
        if line[:1] != ["engaged"]:
            agent.kill()
            raise AssertionError(f"the agent did not engage: {line} {agent.stderr.read() if agent.stderr else ''}")
        return agent, line[1]

    agent, _ = start()
    try:
        engaged = seen["engaged"] = shown(box)
        assert engaged[WORKER_UNIT]["CPUWeight"] == "10000" and engaged[WORKER_UNIT]["IOWeight"] == "1000"
        assert engaged[BATCH_SLICE]["CPUWeight"] == "1" and engaged[BATCH_SLICE]["CPUQuotaPerSecUSec"] == "500ms"
        assert engaged[BATCH_SLICE]["MemoryHigh"] == "67108864"
        assert f"/dev/block/{disks[0]} 33554432" in engaged[BATCH_SLICE]["IOWriteBandwidthMax"]
        box.run("systemctl", "daemon-reload")
        seen["after daemon-reload"] = shown(box)
        assert seen["after daemon-reload"] == engaged  # runtime properties are kept
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write("release\n")
        agent.stdin.flush()
        assert json.loads(agent.stdout.readline()) == []
        agent.wait(30)
    finally:
        if agent.poll() is None:
            agent.kill()
    seen["after release"] = shown(box)
    assert seen["after release"] == before

    agent, pid = start()
    try:
        seen["engaged again"] = shown(box)
        box.run("kill", "-9", pid)  # the agent, by its pid in the container
        agent.wait(30)
        assert box.run("test", "-e", state, check=False).returncode == 0  # what it changed, on disk
        seen["after kill -9"] = shown(box)
        assert seen["after kill -9"] == engaged  # nothing put back yet: systemd keeps them
        restore = box.sh(f"cd /opt/turbonode && {python} -c '{AGENT}' restore {state} {root} '{{}}'").stdout
        assert json.loads(restore) == []
        seen["after the next agent's restore"] = shown(box)
        assert seen["after the next agent's restore"] == before
    finally:
        if agent.poll() is None:
            agent.kill()
        box.run("rm", "-f", state, check=False)
        print("\nsystemctl show, per step:\n" + json.dumps(seen, indent=1))


# ---- for real: a systemd host with cgroup v2 (the VM) ---------------------------------------------


def v2_systemd_host() -> str | None:
    """Why this is not a systemd host with cgroup v2 to run the levers on, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if Path("/proc/1/comm").read_text().strip() != "systemd":
        return "PID 1 is not systemd (the VM of scripts/host_vm.sh is a systemd host with cgroup v2)"
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if not controllers.exists() or not {"cpu", "memory", "io"} <= set(controllers.read_text().split()):
        return "/sys/fs/cgroup is not cgroup v2 with cpu, memory and io"
    return None


@pytest.mark.root
def test_levers_on_this_systemd_host(tmp_path):
    """The whole check, on a systemd host with cgroup v2: a worker service and a batch slice made
    by systemd-run, the real levers engaged through the systemd writer; the units' properties and
    the kernel's files change, survive a daemon-reload, and are put back on release and by the
    next agent after a kill -9."""
    reason = v2_systemd_host()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    worker, batch = f"tn-vm-worker-{tag}.service", f"tnvmbatch{tag}.slice"  # a dash would nest the slice
    job = f"tn-vm-job-{tag}.service"
    subprocess.run(["systemd-run", f"--unit={worker}", "sleep", "600"], check=True)
    subprocess.run(["systemd-run", f"--unit={job}", f"--slice={batch}", "sleep", "600"], check=True)
    try:
        worker_cg, batch_cg = f"/system.slice/{worker}", f"/{batch}"
        disk = (block_devices.mounted_disks() or [None])[0]
        cfg = LeversConfig(
            worker_cgroup=worker_cg,
            best_effort_cgroups=[batch_cg],
            best_effort_cpus=0.5,
            io_throttle_devices=[disk] if disk else [],
            oom_guard=False,
        )
        wanted = {"cpu_share": "test", "memory_squeeze": "test", "io_throttle": "test"}
        files = {
            "worker cpu.weight": f"/sys/fs/cgroup{worker_cg}/cpu.weight",
            "batch cpu.weight": f"/sys/fs/cgroup{batch_cg}/cpu.weight",
            "batch cpu.max": f"/sys/fs/cgroup{batch_cg}/cpu.max",
            "batch memory.high": f"/sys/fs/cgroup{batch_cg}/memory.high",
            "batch io.max": f"/sys/fs/cgroup{batch_cg}/io.max",
        }

        def kernel() -> dict[str, str]:
            return {k: Path(f).read_text().strip() if Path(f).exists() else "-" for k, f in files.items()}

        def props() -> dict[str, str]:
            out = {}
            for unit in (worker, batch):
                res = subprocess.run(
                    ["systemctl", "show", unit, *(f"--property={p}" for p in SHOWN)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                out.update({f"{unit} {k}": v for k, v in (ln.split("=", 1) for ln in res.stdout.splitlines())})
            return out

        def unlimited(state: tuple[dict[str, str], dict[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
            """No write limit, however systemd shows it: once IOWriteBandwidthMax= named a disk, the
            unit keeps that entry at no limit (UINT64_MAX) until reboot, and so the io controller
            for the slice, whose io.max then reads empty instead of not existing."""
            files, shown = state
            files = {**files, "batch io.max": files["batch io.max"] or "-"}
            shown = {k: "" if v.endswith(f" {UINT64_MAX}") else v for k, v in shown.items()}
            return files, shown

        def settled(want: tuple[dict[str, str], dict[str, str]], timeout: float = 10.0) -> tuple:
            """The state once it is `want`, or as it is after `timeout`: systemd applies a unit's
            changed properties to its cgroup (and its parents' controllers) from a queue of its own,
            after the D-Bus call has been answered."""
            end = time.monotonic() + timeout
            while (now := unlimited((kernel(), props()))) != want and time.monotonic() < end:
                time.sleep(0.2)
            return now

        before = unlimited((kernel(), props()))
        state = str(tmp_path / "levers.json")
        levers = Levers(cfg, state, [WorkerCgroup("w", worker_cg, lambda: None)])
        assert levers.writer.backend == "systemd"
        levers.reconcile(wanted, {}, "recovery")
        st = levers.status()
        assert all(st[name]["engaged"] for name in wanted), st
        engaged = (kernel(), props())
        assert engaged[0]["worker cpu.weight"] == "10000" and engaged[0]["batch cpu.weight"] == "1"
        assert engaged[0]["batch cpu.max"] == "50000 100000" and engaged[0]["batch memory.high"] != "max"
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        time.sleep(1)
        assert (kernel(), props()) == engaged  # the kernel's values too: systemd applies its own runtime properties
        levers.reconcile({}, {}, "recovery")
        assert settled(before) == before
        # engaged by an agent that is then killed -9: the next agent's restore puts it back
        kill_9_once(
            textwrap.dedent(f"""
                from agent.levers import Levers
                from agent.levers.cgroup import WorkerCgroup
                from turbonode.config import LeversConfig
                cfg = LeversConfig(worker_cgroup={worker_cg!r}, best_effort_cgroups=[{batch_cg!r}],
                                   best_effort_cpus=0.5, io_throttle_devices={cfg.io_throttle_devices!r},
                                   oom_guard=False)
                levers = Levers(cfg, {state!r}, [WorkerCgroup("w", {worker_cg!r}, lambda: None)])
                levers.reconcile({wanted!r}, {{}}, "recovery")
                assert all(levers.status()[n]["engaged"] for n in {list(wanted)!r}), levers.status()
                print("engaged", flush=True)
                import time; time.sleep(60)
            """)
        )
        assert (kernel(), props()) == engaged
        assert Levers(cfg, state, []).restore_leftovers() == []
        assert settled(before) == before and not os.path.exists(state)
    finally:
        subprocess.run(["systemctl", "stop", worker, job, batch], check=False)
