"""`turboctl doctor`: each check on fake trees for the states this machine cannot show, the same
checks against this real host, and the command through click's CliRunner."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers import BCC_SKIP, KERNEL_SKIP, ROOT
from turboctl import doctor
from turboctl.doctor import FAIL, OK, SKIP, WARN
from turbonode.config import Config, LeversConfig
from turbonode.errors import ControlError
from turbonode.rpc_server import UnixRpcServer

ROOT_CAPS = (1 << 41) - 1


def fake_procfs(
    tmp_path: Path, caps: int = ROOT_CAPS, cap_last: int = 40, mounts: str = "", pressure: bool = True
) -> str:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "status").write_text(f"Name:\tx\nCapInh:\t0\nCapEff:\t{caps:016x}\n")
    (proc / "self" / "mounts").write_text(mounts)
    (proc / "sys" / "kernel").mkdir(parents=True)
    (proc / "sys" / "kernel" / "cap_last_cap").write_text(f"{cap_last}\n")
    (proc / "sys" / "kernel" / "unprivileged_bpf_disabled").write_text("2\n")
    if pressure:
        (proc / "pressure").mkdir()
        for res in ("cpu", "memory", "io"):
            (proc / "pressure" / res).write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    return str(proc)


# ---- privileges ---------------------------------------------------------------------------------


def test_privileges_names_the_missing_capabilities(tmp_path):
    assert doctor.check_privileges(fake_procfs(tmp_path)).status == OK
    net_admin_only = 1 << doctor.CAP_NET_ADMIN
    c = doctor.check_privileges(fake_procfs(tmp_path / "a", caps=net_admin_only))
    assert c.status == FAIL and "CAP_BPF, CAP_PERFMON" in c.detail and c.fix
    # a kernel older than 5.8 has no CAP_BPF: CAP_SYS_ADMIN is what loads programs there
    old = fake_procfs(tmp_path / "b", caps=net_admin_only | 1 << doctor.CAP_SYS_ADMIN, cap_last=37)
    assert doctor.check_privileges(old).status == OK
    c = doctor.check_privileges(fake_procfs(tmp_path / "c", caps=net_admin_only, cap_last=37))
    assert c.status == FAIL and "CAP_SYS_ADMIN" in c.detail


def test_bpf_syscall_outcomes(tmp_path):
    procfs = fake_procfs(tmp_path)
    assert doctor.check_bpf_syscall(lambda: 0, procfs).status == OK
    c = doctor.check_bpf_syscall(lambda: errno.EPERM, procfs)
    assert c.status == FAIL and "unprivileged_bpf_disabled = 2" in c.detail
    assert "CONFIG_BPF_SYSCALL" in doctor.check_bpf_syscall(lambda: errno.ENOSYS, procfs).detail


@pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
def test_bpf_syscall_for_real():
    assert doctor.bpf_map_create() == 0
    # without privileges the same probe is refused (the child drops every capability first)
    code = (
        "import os; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
        "from turboctl.doctor import bpf_map_create; print(bpf_map_create())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    unprivileged_allowed = Path("/proc/sys/kernel/unprivileged_bpf_disabled").read_text().strip() == "0"
    assert int(out.stdout) == 0 if unprivileged_allowed else int(out.stdout) == errno.EPERM


# ---- kernel -------------------------------------------------------------------------------------


def test_btf(tmp_path):
    assert doctor.check_btf(str(tmp_path)).status == WARN
    (tmp_path / "kernel" / "btf").mkdir(parents=True)
    (tmp_path / "kernel" / "btf" / "vmlinux").write_bytes(b"\0" * 4096)
    assert doctor.check_btf(str(tmp_path)).status == OK


def test_kernel_headers_own_generic_or_missing(tmp_path):
    modules, src = tmp_path / "modules", tmp_path / "src"
    c = doctor.check_kernel_headers(str(modules), "6.18.1-x")
    assert c.status == FAIL and "linux-headers-6.18.1-x" in c.fix
    (src / "linux-headers-6.18.1-x").mkdir(parents=True)
    (src / "linux-headers-6.1.0-57-amd64").mkdir()
    (modules / "6.18.1-x").mkdir(parents=True)
    (modules / "6.18.1-x" / "build").symlink_to(src / "linux-headers-6.18.1-x")
    c = doctor.check_kernel_headers(str(modules), "6.18.1-x")
    assert c.status == OK and "fallback" not in c.detail
    (modules / "6.18.1-x" / "build").unlink()
    (modules / "6.18.1-x" / "build").symlink_to(src / "linux-headers-6.1.0-57-amd64")
    c = doctor.check_kernel_headers(str(modules), "6.18.1-x")
    assert c.status == OK and "generic fallback" in c.detail


def test_bcc_load_failure_is_reported():
    def broken():
        raise Exception("Unable to find kernel headers. Try rebuilding kernel with CONFIG_IKHEADERS=m")

    c = doctor.check_bcc(broken)
    assert c.status == FAIL and "Unable to find kernel headers" in c.detail
    assert doctor.check_bcc(lambda: None).status == OK


@pytest.mark.skipif(BCC_SKIP is not None, reason=BCC_SKIP or "")
def test_bcc_for_real():
    assert doctor.check_bcc().status == OK


MOUNTS_HYBRID = """sysfs /sys sysfs rw 0 0
bpf /sys/fs/bpf bpf rw 0 0
tmpfs /sys/fs/cgroup tmpfs rw 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0
"""
MOUNTS_V2 = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\ntracefs /sys/kernel/debug/tracing tracefs rw 0 0\n"


def test_mounts_and_cgroups_from_the_mount_table(tmp_path):
    hybrid = fake_procfs(tmp_path / "h", mounts=MOUNTS_HYBRID)
    v2 = fake_procfs(tmp_path / "v2", mounts=MOUNTS_V2)
    assert doctor.check_mount("bpf", ("fs/bpf",), hybrid).status == OK
    c = doctor.check_mount("bpf", ("fs/bpf",), v2)
    assert c.status == FAIL and "mount -t bpf bpf /sys/fs/bpf" in c.fix
    tracing = ("kernel/tracing", "kernel/debug/tracing")
    assert doctor.check_mount("tracefs", tracing, hybrid).status == FAIL
    assert "debug/tracing" in doctor.check_mount("tracefs", tracing, v2).detail
    c = doctor.check_cgroups(hybrid)
    assert c.status == OK and "hybrid" in c.detail and "cpu,cpuacct" in c.detail and "unified" in c.detail
    assert doctor.check_cgroups(v2).detail.startswith("v2")
    assert doctor.check_cgroups(fake_procfs(tmp_path / "none")).status == WARN


def test_io_weights_say_what_the_disks_allow(tmp_path):
    """A disk no proportional io policy schedules (mq-deadline, none): io_weight caps the
    best-effort writes instead, or stays off; the doctor says which and why."""
    from tests.agent.helpers import fake_blkio, fake_sysfs
    from tests.agent.helpers import fake_procfs as io_procfs

    root, proc = fake_blkio(tmp_path), io_procfs(tmp_path)
    cfg = Config(levers=LeversConfig(cgroup_root=str(root), best_effort_cgroups=["/batch"]))
    c = doctor.check_io_policy(cfg, str(proc), str(fake_sysfs(tmp_path)))
    assert c.status == WARN and c.detail.startswith("no proportional io policy on 254:0 (scheduler mq-deadline)")
    assert "best-effort writes capped instead" in c.detail and "bfq" in c.fix
    c = doctor.check_io_policy(Config(levers=LeversConfig(cgroup_root=str(root))), str(proc), str(tmp_path / "sys"))
    assert c.status == WARN and c.detail.startswith("io_weight stays off") and "levers.best_effort_cgroups" in c.fix
    (root / "blkio/blkio.bfq.weight").write_text("100\n")
    for q in (tmp_path / "sys/devices/virtual/block").glob("*/queue/scheduler"):
        q.write_text("mq-deadline kyber [bfq] none\n")
    c = doctor.check_io_policy(cfg, str(proc), str(tmp_path / "sys"))
    assert c == doctor.Check("io weights", OK, "weights act on 254:0 (bfq), 259:0 (bfq)")


def test_lever_writer_as_pid_1_is(tmp_path):
    proc = Path(fake_procfs(tmp_path))
    (proc / "1").mkdir()
    (proc / "1/comm").write_text("bash\n")
    c = doctor.check_lever_writer(Config(), str(proc), str(tmp_path / "booted"))
    assert c == doctor.Check("lever writer", OK, "cgroupfs: PID 1 is bash, not systemd: cgroup files written directly")
    (proc / "1/comm").write_text("systemd\n")
    (tmp_path / "booted").mkdir()
    from agent.levers import systemd_bus

    with pytest.MonkeyPatch.context() as mp:  # a systemd whose socket is not there
        mp.setattr(systemd_bus, "SYSTEM_BUS", str(tmp_path / "no-socket"))
        c = doctor.check_lever_writer(Config(), str(proc), str(tmp_path / "booted"))
    assert c.status == FAIL and c.detail.startswith("systemd: PID 1 is systemd") and "cannot connect" in c.detail


def test_softirq_tracepoints(tmp_path):
    assert doctor.check_softirq_tracepoints(str(tmp_path)).status == SKIP
    irq = tmp_path / "kernel" / "tracing" / "events" / "irq"
    for tp in ("softirq_entry", "softirq_exit"):
        (irq / tp).mkdir(parents=True)
    c = doctor.check_softirq_tracepoints(str(tmp_path))
    assert c.status == WARN and "irq:softirq_raise" in c.detail
    (irq / "softirq_raise").mkdir()
    assert doctor.check_softirq_tracepoints(str(tmp_path)).status == OK


# ---- traffic control ----------------------------------------------------------------------------


def fake_tc(available: set[str]):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        kind = "htb" if "htb" in argv else argv[-1]
        return subprocess.CompletedProcess(
            argv, 0 if kind in available else 2, "", "Error: Specified qdisc kind is unknown."
        )

    return run, calls


@pytest.mark.skipif(os.geteuid() != 0, reason="the qdisc probe needs root")
def test_qdisc_probe_on_fake_kernels():
    run, calls = fake_tc({"htb", "clsact", "fq_codel"})
    assert doctor.check_qdiscs(run).status == OK
    assert all(argv[:3] == ["unshare", "--net", "--"] for argv in calls)  # never the host's interfaces
    run, _ = fake_tc({"htb", "clsact"})
    c = doctor.check_qdiscs(run)
    assert c.status == WARN and "missing: fq_codel" in c.detail and "pfifo" in c.fix
    run, _ = fake_tc({"clsact", "fq_codel"})
    assert doctor.check_qdiscs(run).status == FAIL


@pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
def test_qdisc_probe_for_real():
    c = doctor.check_qdiscs()
    # docs/design.md: the development kernel has HTB built in
    assert c.status in (OK, WARN) and "htb" in c.detail.split(";")[0], c


def test_interface(tmp_path):
    assert doctor.check_interface("", "", str(tmp_path)).status == WARN
    assert doctor.check_interface("eth7", "", str(tmp_path)).status == FAIL
    (tmp_path / "class" / "net" / "eth7").mkdir(parents=True)
    assert doctor.check_interface("eth7", "", str(tmp_path)).status == OK


def test_interface_in_a_namespace(sandbox):
    assert doctor.check_interface(sandbox.dev, sandbox.server).status == OK
    c = doctor.check_interface("nosuchdev0", sandbox.server)
    assert c.status == FAIL and sandbox.server in c.detail


# ---- pressure -------------------------------------------------------------------------------------


def test_psi_missing_and_present(tmp_path):
    c = doctor.check_psi(fake_procfs(tmp_path / "a", pressure=False))
    assert c.status == WARN and "psi=1" in c.fix
    c = doctor.check_psi(fake_procfs(tmp_path / "b"))
    assert "cpu, memory, io" in c.detail


def test_psi_for_real():
    if not os.path.isdir("/proc/pressure"):
        pytest.skip("kernel without PSI")
    c = doctor.check_psi()
    assert c.status in (OK, WARN) and "cpu" in c.detail, c


# ---- GPU, torch, TensorRT -------------------------------------------------------------------------


def fake_nvml(names: list[str] | None):
    class NVMLError(Exception):
        pass

    def init():
        if names is None:
            raise NVMLError("NVML Shared Library Not Found")

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(names or []),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h].encode(),
        nvmlSystemGetDriverVersion=lambda: b"580.65.06",
    )


def test_nvml():
    assert doctor.check_nvml(False, fake_nvml(None)).status == WARN
    c = doctor.check_nvml(True, fake_nvml(None))
    assert c.status == FAIL and "driver" in c.fix
    c = doctor.check_nvml(True, fake_nvml(["NVIDIA H200", "NVIDIA H200"]))
    assert c.status == OK and "580.65.06" in c.detail and "1: NVIDIA H200" in c.detail
    assert doctor.check_nvml(True, fake_nvml([])).status == FAIL


def test_torch_tensorrt_and_device():
    cpu = {"version": "2.13.0+cpu", "cuda": None, "cuda_available": False, "devices": 0}
    gpu = {"version": "2.11.0", "cuda": "13.0", "cuda_available": True, "devices": 2}
    assert doctor.check_torch(None, False).status == WARN
    assert doctor.check_torch(cpu, False).status == OK
    assert doctor.check_torch(cpu, True).status == FAIL
    assert "2 device(s)" in doctor.check_torch(gpu, True).detail
    assert doctor.check_tensorrt("tensorrt", False).status == FAIL  # not installed here, or no GPU
    assert doctor.check_device("cpu", 0).status == OK
    assert "cpu" in doctor.check_device("auto", 0).detail
    assert doctor.check_device("cuda:1", 2).status == OK
    c = doctor.check_device("cuda:2", 2)
    assert c.status == FAIL and "2 CUDA device(s)" in c.detail


def test_torch_facts_for_real():
    facts = doctor.torch_facts()
    assert facts is not None and facts["version"]


# ---- the worker's socket --------------------------------------------------------------------------


def test_worker_socket_states(tmp_path):
    path = tmp_path / "worker.sock"
    c = doctor.check_worker_socket(str(path), "root")
    assert c.status == WARN and "not running" in c.detail
    assert "does not exist" in doctor.check_worker_socket(str(path), "no-such-group-x").detail
    path.write_text("")
    assert doctor.check_worker_socket(str(path), "root").status == FAIL

    def refused(p):
        raise ControlError(f"no permission to connect to {p} (need the turbonode group or root)")

    path.unlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        c = doctor.check_worker_socket(str(path), "turbonode", refused)
    assert c.status == FAIL and "usermod -aG turbonode" in c.fix


def test_worker_socket_answers_for_real(tmp_path):
    path = str(tmp_path / "worker.sock")
    server = UnixRpcServer(path, {"ping": lambda: {"pid": os.getpid()}}).start()
    try:
        c = doctor.check_worker_socket(path, "root")
    finally:
        server.close()
    assert c.status == OK and f"pid {os.getpid()}" in c.detail, c


def test_each_worker_of_the_node_is_checked(tmp_path):
    """[workers.<name>]: each worker's device, its GPU as NVML sees it, its socket answering as it."""
    assert doctor.check_worker_gpu("a", 1, fake_nvml(["NVIDIA H200", "NVIDIA H200"])).status == OK
    c = doctor.check_worker_gpu("a", 5, fake_nvml(["NVIDIA H200", "NVIDIA H200"]))
    assert c.status == FAIL and "NVML sees 2 GPU(s)" in c.detail and "workers.a.gpu to 0..1" in c.fix
    c = doctor.check_worker_gpu("a", 0, fake_nvml(None))
    assert c.status == FAIL and "NVML is unavailable" in c.detail
    path = str(tmp_path / "worker-a.sock")
    server = UnixRpcServer(path, {"ping": lambda: {"pid": os.getpid(), "name": "b"}}).start()
    try:
        c = doctor.check_worker_socket(path, "root", name="a")  # b answers at a's socket
    finally:
        server.close()
    assert c.name == "worker a socket" and c.status == FAIL and "answers as worker b" in c.detail, c
    cfg = tmp_path / "t.toml"
    cfg.write_text(
        f'[worker]\ncontrol_socket = "{tmp_path}/worker.sock"\n[workers.a]\ngpu = 0\n[workers.b]\ndevice = "cpu"\n'
    )
    out = json.loads(CliRunner().invoke(doctor.command, ["--config", str(cfg), "--json"]).output)
    by_name = {c["name"]: c for c in out["checks"]}
    assert {"workers.a.device", "worker a GPU", "worker a socket", "workers.b.device", "worker b socket"} <= set(
        by_name
    ), sorted(by_name)
    assert "worker b GPU" not in by_name and by_name["workers.b.device"]["status"] == OK
    assert f"{tmp_path}/worker-b.sock does not exist" in by_name["worker b socket"]["detail"]
    assert "turbonode-worker@b" in by_name["worker b socket"]["fix"]


# ---- the command ----------------------------------------------------------------------------------


def test_command_json_and_exit_status(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[worker]\ndevice = "cuda:3"\ncontrol_socket = "{tmp_path}/w.sock"\n')
    res = CliRunner().invoke(doctor.command, ["--config", str(cfg), "--json"])
    assert res.exit_code == 1, res.output  # no cuda:3 here (nor anywhere CI runs)
    out = json.loads(res.output)
    by_name = {c["name"]: c for c in out["checks"]}
    assert by_name["configuration"]["status"] == OK
    assert by_name["worker.device"]["status"] == FAIL and out["failed"] >= 1
    assert by_name["worker socket"]["status"] == WARN
    expected = {
        "privileges",
        "bpf syscall",
        "BTF",
        "kernel headers",
        "bcc",
        "bpffs",
        "tracefs",
        "softirq tracepoints",
        "qdiscs",
        "qos.dev",
        "PSI",
        "cgroups",
        "io weights",
        "lever writer",
        "NVML / GPU",
        "torch",
        "TensorRT",
    }
    assert expected <= set(by_name)


def test_command_names_a_bad_key_and_goes_on(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[worker]\nmax_batch = 0\n")
    res = CliRunner().invoke(doctor.command, ["--config", str(cfg)])
    assert res.exit_code == 1
    assert "FAIL  configuration" in res.output and "worker.max_batch" in res.output
    assert "torch" in res.output  # the other checks still ran, on the defaults


@pytest.mark.skipif(BCC_SKIP is not None, reason=BCC_SKIP or "")
def test_command_on_this_host(tmp_path):
    """What scripts/setup.sh leaves on a host (docs/cli.md, the host), as the doctor reports it."""
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[worker]\ndevice = "cpu"\ncontrol_socket = "{tmp_path}/w.sock"\n')
    res = CliRunner().invoke(doctor.command, ["--config", str(cfg)])
    lines = {
        line.split()[1]: line.split()[0]
        for line in res.output.splitlines()
        if line[:4] in ("ok  ", "warn", "FAIL", "skip")
    }
    for name in ("privileges", "bpf", "BTF", "bcc", "bpffs", "tracefs", "torch"):
        assert lines.get(name) == "ok", res.output
    assert res.exit_code == 0, res.output
