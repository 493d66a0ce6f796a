"""`turboctl doctor`: check a host for what turbonode needs, one line per check, and what to do.

Like `cilium status` or `bpftool feature probe`: every check is a small function that reads
the roots it is given (procfs, sysfs, /lib/modules ...) or probes the running kernel through
an injectable edge, and returns a Check; tests point them at fake trees. Probes that change
anything do it where nothing can notice: qdiscs are tried on `lo` of a throwaway network
namespace, the bpf() probe creates a one-entry map and closes it.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import importlib.util
import ipaddress
import json
import os
import platform
import stat
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import click

from agent.mounts import mounted_types
from turbonode.accounts import load_keys, parse_period
from turbonode.config import (
    DEFAULT_PATH,
    DEFAULT_WORKER,
    Config,
    WorkerConfig,
    instance_worker,
    load_config,
    node_workers,
)
from turbonode.errors import ConfigError, ControlError
from turbonode.jsonrpc import ControlClient

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
SETUP = "bash scripts/setup.sh"

# linux/capability.h bit numbers
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 12, 21, 38, 39
CAP_NAMES = {
    CAP_NET_ADMIN: "CAP_NET_ADMIN",
    CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
    CAP_PERFMON: "CAP_PERFMON",
    CAP_BPF: "CAP_BPF",
}

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str | None = None


# ---- privileges and the bpf() syscall ---------------------------------------------------------


def effective_caps(procfs: str = "/proc") -> int:
    with open(os.path.join(procfs, "self", "status")) as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    raise ValueError(f"{procfs}/self/status has no CapEff line")


def _cap_last(procfs: str) -> int:
    try:
        with open(os.path.join(procfs, "sys", "kernel", "cap_last_cap")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return CAP_BPF  # unknown: assume a kernel >= 5.8


def check_privileges(procfs: str = "/proc") -> Check:
    """The agent needs CAP_NET_ADMIN, and CAP_BPF + CAP_PERFMON (CAP_SYS_ADMIN before Linux 5.8)."""
    try:
        caps = effective_caps(procfs)
    except (OSError, ValueError) as exc:
        return Check("privileges", FAIL, f"cannot read capabilities: {exc}")
    bpf_caps = (CAP_BPF, CAP_PERFMON) if _cap_last(procfs) >= CAP_BPF else (CAP_SYS_ADMIN,)
    need = (CAP_NET_ADMIN, *bpf_caps)
    missing = [CAP_NAMES[c] for c in need if not caps >> c & 1]
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    if missing:
        return Check(
            "privileges",
            FAIL,
            f"{who} without {', '.join(missing)}: the agent cannot load eBPF or shape",
            "run the agent as systemd/turbonode-agent.service does (root with those capabilities); "
            "`turboctl status` and `render` need no privileges",
        )
    return Check("privileges", OK, f"{who} with {', '.join(CAP_NAMES[c] for c in need)}")


BPF_MAP_CREATE, BPF_MAP_TYPE_ARRAY = 0, 2
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}


def bpf_map_create() -> int:
    """bpf(BPF_MAP_CREATE) of a one-entry array; returns 0 on success or the errno (the map is closed)."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 5)(BPF_MAP_TYPE_ARRAY, 4, 4, 1, 0)  # type, key size, value size, entries, flags
    fd = libc.syscall(nr, BPF_MAP_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def check_bpf_syscall(probe: Callable[[], int] = bpf_map_create, procfs: str = "/proc") -> Check:
    err = probe()
    if err == 0:
        return Check("bpf syscall", OK, "bpf(BPF_MAP_CREATE) works")
    if err == errno.ENOSYS:
        return Check("bpf syscall", FAIL, "the kernel has no bpf() (CONFIG_BPF_SYSCALL)", "a kernel built with BPF")
    if err == errno.EPERM:
        try:
            with open(os.path.join(procfs, "sys", "kernel", "unprivileged_bpf_disabled")) as f:
                knob = f"kernel.unprivileged_bpf_disabled = {f.read().strip()}"
        except OSError:
            knob = "unprivileged bpf unknown"
        return Check("bpf syscall", FAIL, f"bpf() not permitted ({knob})", "run as root or with CAP_BPF")
    return Check("bpf syscall", FAIL, f"bpf(BPF_MAP_CREATE) failed: {os.strerror(err)}")


# ---- kernel: BTF, headers for bcc, mounts, tracepoints ----------------------------------------


def check_btf(sysfs: str = "/sys") -> Check:
    path = os.path.join(sysfs, "kernel", "btf", "vmlinux")
    if os.path.exists(path):
        return Check("BTF", OK, f"{path} ({os.path.getsize(path) // 1024} KiB)")
    return Check(
        "BTF",
        WARN,
        f"{path} missing: kernel without CONFIG_DEBUG_INFO_BTF",
        "not needed by turbonode's programs (bcc compiles against headers); CO-RE tools need it",
    )


def check_kernel_headers(modules: str = "/lib/modules", release: str | None = None) -> Check:
    """bcc compiles against <modules>/<release>/build: the kernel's own headers or the generic fallback."""
    release = release or os.uname().release
    build = os.path.join(modules, release, "build")
    if not os.path.exists(build):
        return Check(
            "kernel headers",
            FAIL,
            f"{build} missing: bcc cannot compile the classifier",
            f"apt-get install linux-headers-{release}, or {SETUP} (links the generic headers)",
        )
    target = os.path.realpath(build)
    if release in os.path.basename(target):
        return Check("kernel headers", OK, f"{build} -> {target}")
    return Check(
        "kernel headers",
        OK,
        f"{build} -> {target}: the generic fallback (no headers package for "
        f"{release}; turbonode's programs use only stable UAPI)",
    )


def check_bcc(load: Callable[[], None] | None = None) -> Check:
    """bcc importable and able to compile and load a program (bpf/noop.c) into this kernel."""
    if load is None:
        if importlib.util.find_spec("bcc") is None:
            return Check(
                "bcc",
                FAIL,
                "python module bcc not importable",
                f"apt-get install python3-bpfcc, and a venv with --system-site-packages ({SETUP})",
            )
        load = _load_noop
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception for compile and load errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Check("bcc", FAIL, f"compiling bpf/noop.c failed: {first}", "see `kernel headers` above")
    return Check("bcc", OK, "compiled and loaded bpf/noop.c (SCHED_CLS)")


def _load_noop() -> None:
    from bcc import BPF

    import bpf

    b = BPF(src_file=bpf.source("noop.c"), cflags=["-DDEFAULT_MINOR=0x30"])
    try:
        b.load_func("classify", BPF.SCHED_CLS)
    finally:
        b.cleanup()


def check_mount(fstype: str, points: tuple[str, ...], procfs: str = "/proc", sysfs: str = "/sys") -> Check:
    """bpffs (pinned maps) or tracefs (tracepoints) mounted at one of `points` under sysfs."""
    name = "bpffs" if fstype == "bpf" else fstype
    try:
        table = mounted_types(procfs)
    except OSError as exc:
        return Check(name, FAIL, f"cannot read the mount table: {exc.strerror}")
    paths = [os.path.join(sysfs, p) for p in points]
    for path in paths:
        if table.get(path) == fstype:
            return Check(name, OK, f"mounted at {path}")
    return Check(
        name,
        FAIL,
        f"not mounted at {paths[0]}",
        f"mount -t {fstype} {'bpf' if fstype == 'bpf' else 'nodev'} {paths[0]} (the agent and its unit do it at start)",
    )


def check_softirq_tracepoints(sysfs: str = "/sys") -> Check:
    from agent.watchers.softirq import TRACEPOINTS, tracefs_dirs

    for base in tracefs_dirs(sysfs):
        if os.path.isdir(os.path.join(base, "events")):
            missing = [tp for tp in TRACEPOINTS if not os.path.isdir(os.path.join(base, "events", "irq", tp))]
            if missing:
                return Check(
                    "softirq tracepoints",
                    WARN,
                    f"irq:{', irq:'.join(missing)} missing in {base}",
                    "the agent falls back to /proc/softirqs counts, without latency",
                )
            return Check("softirq tracepoints", OK, f"irq:{', irq:'.join(TRACEPOINTS)} in {base}")
    return Check("softirq tracepoints", SKIP, "tracefs not mounted: cannot list tracepoints", "mount tracefs first")


# ---- traffic control ---------------------------------------------------------------------------

# kind -> (status when missing, `tc qdisc add dev lo` arguments)
QDISCS = {"htb": (FAIL, "root handle 1: htb"), "clsact": (WARN, "clsact"), "fq_codel": (WARN, "root fq_codel")}
QDISC_NOTES = {
    "htb": "the tier tree needs HTB (CONFIG_NET_SCH_HTB)",
    "clsact": "no clsact: eBPF tools that attach at ingress/egress (not turbonode's HTB filter) fail",
    "fq_codel": "the tier leaves use pfifo instead of fq_codel",
}


def check_qdiscs(run: Runner = subprocess.run) -> Check:
    """Try each qdisc on `lo` of a throwaway network namespace (`unshare --net`): the kernel
    answers (and loads the module) exactly as it will for the real device."""
    if os.geteuid() != 0:
        return Check("qdiscs", SKIP, "needs root to probe (unshare --net)")
    have, missing, worst = [], [], OK
    for kind, (severity, args) in QDISCS.items():
        try:
            res = run(
                ["unshare", "--net", "--", "tc", "qdisc", "add", "dev", "lo", *args.split()],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Check("qdiscs", FAIL, f"cannot probe: {exc}", "install util-linux (unshare) and iproute2 (tc)")
        if res.returncode == 0:
            have.append(kind)
            continue
        missing.append(kind)
        worst = FAIL if FAIL in (worst, severity) else WARN
    detail = f"available: {', '.join(have) or 'none'}" + (f"; missing: {', '.join(missing)}" if missing else "")
    notes = [QDISC_NOTES[k] for k in missing]
    return Check("qdiscs", worst, detail, "; ".join(notes) or None)


def check_interface(dev: str, netns: str, sysfs: str = "/sys", run: Runner = subprocess.run) -> Check:
    if not dev:
        return Check(
            "qos.dev",
            WARN,
            "not set: the agent watches but shapes no interface",
            "set qos.dev (and qos.rate) in the configuration",
        )
    if not netns:
        if os.path.isdir(os.path.join(sysfs, "class", "net", dev)):
            return Check("qos.dev", OK, f"{dev} exists")
        return Check("qos.dev", FAIL, f"no interface {dev}", "`ip link` lists them; fix qos.dev")
    res = run(["ip", "-n", netns, "link", "show", "dev", dev], capture_output=True, text=True, timeout=10)
    if res.returncode == 0:
        return Check("qos.dev", OK, f"{dev} exists in netns {netns}")
    return Check("qos.dev", FAIL, f"no interface {dev} in netns {netns}: {res.stderr.strip()}")


# ---- pressure, cgroups -------------------------------------------------------------------------


def check_psi(procfs: str = "/proc", stall_us: int = 100_000) -> Check:
    path = os.path.join(procfs, "pressure")
    if not os.path.isdir(path):
        return Check("PSI", WARN, f"{path} missing: kernel without PSI", "boot with psi=1 (CONFIG_PSI)")
    from agent.watchers.psi import RESOURCES, PsiTriggers

    present = [r for r in RESOURCES if os.path.exists(os.path.join(path, r))]
    triggers = PsiTriggers(procfs, stall_us, present)
    try:
        if triggers.error:
            return Check(
                "PSI",
                WARN,
                f"{', '.join(present)} readable; triggers: {triggers.error}",
                "the agent samples at its fixed period instead of waking on stalls",
            )
        return Check("PSI", OK, f"{', '.join(present)} with triggers")
    finally:
        triggers.close()


def check_cgroups(procfs: str = "/proc", sysfs: str = "/sys") -> Check:
    try:
        table = mounted_types(procfs)
    except OSError as exc:
        return Check("cgroups", WARN, f"cannot read the mount table: {exc.strerror}")
    root = os.path.join(sysfs, "fs", "cgroup")
    if table.get(root) == "cgroup2":
        return Check("cgroups", OK, f"v2 (unified) at {root}")
    v1 = sorted(os.path.basename(p) for p, t in table.items() if t == "cgroup" and p.startswith(root + "/"))
    if v1:
        unified = " + cgroup2 at " + root + "/unified" if table.get(os.path.join(root, "unified")) == "cgroup2" else ""
        return Check("cgroups", OK, f"v1 ({', '.join(v1)}){unified}: hybrid hierarchy")
    return Check("cgroups", WARN, f"no cgroup filesystem under {root}")


def check_io_policy(cfg: Config, procfs: str = "/proc", sysfs: str = "/sys") -> Check:
    """What the io_weight lever can do on this host's disks (agent/levers/io_policy.py): weights
    where BFQ or io.cost schedules a disk, else the best-effort cgroups' writes capped, else off."""
    from agent.levers.io import io_policy_status
    from agent.levers.io_policy import BOTH, OFF, THROTTLE
    from agent.levers.writers import choose_writer

    writer = choose_writer(procfs, cfg.levers.cgroup_root)  # systemd brings io.max into being for a unit
    policy = io_policy_status(cfg.levers, procfs, sysfs, writer.enables)
    mode, summary = policy["mode"], policy["summary"]
    weights = "BFQ as the disk's scheduler (echo bfq > /sys/block/DISK/queue/scheduler) or, on cgroup v2, io.cost"
    if mode == THROTTLE or mode == BOTH:
        return Check("io weights", WARN, summary, f"io_weight caps writes there; for weights: {weights}")
    if mode == OFF:
        return Check(
            "io weights",
            WARN,
            f"io_weight stays off: {summary}",
            f"list levers.best_effort_cgroups (their writes are capped where weights do nothing), or {weights}",
        )
    return Check("io weights", OK, summary)


def check_lever_writer(cfg: Config, procfs: str = "/proc", booted: str = "/run/systemd/system") -> Check:
    """Who applies the levers (agent/levers/writers.py): systemd where it is PID 1, after a call
    to it over D-Bus answers; else the cgroup files."""
    from agent.levers.systemd_bus import SystemdError
    from agent.levers.writers import SYSTEMD, choose_writer

    writer = choose_writer(procfs, cfg.levers.cgroup_root, booted)
    if writer.backend != SYSTEMD or writer.bus is None:
        return Check("lever writer", OK, f"cgroupfs: {writer.why}")
    try:
        writer.bus.get_property("-.slice", "CPUWeight")
    except SystemdError as exc:
        return Check(
            "lever writer",
            FAIL,
            f"systemd: {writer.why}, but D-Bus does not answer: {exc}",
            "install and start the system bus (apt-get install dbus): the agent sets unit properties over it",
        )
    finally:
        writer.bus.close()
    return Check("lever writer", OK, f"systemd: {writer.why}; D-Bus answers")


# ---- GPU, torch, TensorRT, the worker ----------------------------------------------------------


def gpu_expected(cfg: Config) -> bool:
    return cfg.worker.backend == "tensorrt" or any(w.device.startswith("cuda") or w.gpus for w in node_workers(cfg))


def _nvml_module(nvml: Any = None) -> Any:
    return importlib.import_module("pynvml") if nvml is None else nvml


def check_nvml(expect_gpu: bool, nvml: Any = None) -> Check:
    try:
        nvml = _nvml_module(nvml)
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError (no driver), ImportError
        status = FAIL if expect_gpu else WARN
        return Check(
            "NVML / GPU",
            status,
            f"NVML unavailable ({exc}): no GPU metrics",
            "install the NVIDIA driver (and nvidia-ml-py)"
            if expect_gpu
            else "fine for a CPU node; the dashboard's GPU row stays empty",
        )
    try:
        names = []
        for i in range(nvml.nvmlDeviceGetCount()):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    finally:
        nvml.nvmlShutdown()
    if not names:
        return Check("NVML / GPU", FAIL if expect_gpu else WARN, f"driver {driver}, no GPU")
    return Check("NVML / GPU", OK, f"driver {driver}: {', '.join(f'{i}: {n}' for i, n in enumerate(names))}")


def torch_facts() -> dict[str, Any] | None:
    """torch's version and CUDA devices; None when torch is not installed (imports it: ~1 s)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    cuda = torch.cuda.is_available()
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "devices": torch.cuda.device_count() if cuda else 0,
    }


def check_torch(facts: dict[str, Any] | None, expect_gpu: bool) -> Check:
    if facts is None:
        return Check(
            "torch",
            WARN,
            "not installed: this host cannot run the worker",
            "pip install 'turbonode[worker]' (agent-only hosts do not need it)",
        )
    if facts["cuda_available"]:
        return Check("torch", OK, f"{facts['version']}, CUDA {facts['cuda']}, {facts['devices']} device(s)")
    build = f"CUDA {facts['cuda']} build" if facts["cuda"] else "CPU build"
    return Check(
        "torch",
        FAIL if expect_gpu else OK,
        f"{facts['version']} ({build}), no CUDA device",
        "a CUDA torch and the NVIDIA driver" if expect_gpu else None,
    )


def check_tensorrt(backend: str, cuda_available: bool) -> Check:
    spec = importlib.util.find_spec("tensorrt")
    if spec is None:
        if backend == "tensorrt":
            return Check(
                "TensorRT",
                FAIL,
                "worker.backend = tensorrt but tensorrt is not installed",
                "pip install 'turbonode[tensorrt]' on a GPU host",
            )
        return Check("TensorRT", SKIP, f"not installed (worker.backend = {backend}: torch renders)")
    if not cuda_available:
        return Check("TensorRT", FAIL if backend == "tensorrt" else WARN, "installed, but no CUDA device to run it")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Check("TensorRT", OK, f"tensorrt {version('tensorrt')}")
    except PackageNotFoundError:
        return Check("TensorRT", OK, "tensorrt importable")


def check_device(device: str, cuda_devices: int, key: str = "worker.device") -> Check:
    if device == "cpu":
        return Check(key, OK, "cpu")
    if device == "auto":
        return Check(key, OK, f"auto: {'cuda:0' if cuda_devices else 'cpu (no CUDA device)'}")
    index = device.partition(":")[2] or "0"
    if device.startswith("cuda") and index.isdigit() and int(index) < cuda_devices:
        return Check(key, OK, device)
    return Check(
        key, FAIL, f"{device}: {cuda_devices} CUDA device(s) here", f"set {key} to auto, cpu or an existing cuda:N"
    )


def check_worker_gpu(name: str, index: int, nvml: Any = None) -> Check:
    """The GPU `[workers.<name>] gpu` names, as NVML (the agent's GPU watcher) sees it."""
    what = f"worker {name} GPU"
    try:
        nvml = _nvml_module(nvml)
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError (no driver), ImportError
        return Check(what, FAIL, f"gpu {index}, but NVML is unavailable ({exc})", "install the NVIDIA driver")
    try:
        count = nvml.nvmlDeviceGetCount()
        if index >= count:
            return Check(
                what, FAIL, f"gpu {index}: NVML sees {count} GPU(s)", f"set workers.{name}.gpu to 0..{count - 1}"
            )
        gpu = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
    finally:
        nvml.nvmlShutdown()
    return Check(what, OK, f"gpu {index}: {gpu.decode() if isinstance(gpu, bytes) else gpu}")


def check_worker_socket(
    path: str, group: str, ping: Callable[[str], Any] | None = None, name: str = DEFAULT_WORKER
) -> Check:
    """The worker's control socket: there, reachable by the group, answering as worker `name`."""
    what = "worker socket" if name == DEFAULT_WORKER else f"worker {name} socket"
    try:
        gid: int | None = grp.getgrnam(group).gr_gid
    except KeyError:
        gid = None
    group_note = "" if gid is not None else f"; group {group} does not exist"
    group_fix = f"systemd-sysusers (systemd/turbonode.sysusers.conf creates group {group})" if gid is None else None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Check(
            what,
            WARN,
            f"{path} does not exist: the worker is not running{group_note}",
            f"systemctl start turbonode-worker@{name}" + (f"; {group_fix}" if group_fix else ""),
        )
    except PermissionError:
        return Check(
            what,
            FAIL,
            f"cannot see {path}: no permission on its directory",
            f"usermod -aG {group} $USER (then log in again)",
        )
    if not stat.S_ISSOCK(st.st_mode):
        return Check(what, FAIL, f"{path} is not a socket", "remove it; the worker creates its socket")
    ping = ping or (lambda p: ControlClient(p, timeout=2.0).call("ping"))
    try:
        answer = ping(path)
    except ControlError as exc:
        if "loading" in str(exc):  # bound early, answering once the model has loaded
            return Check(what, WARN, f"{path}: {exc}", "wait; `turboctl status` shows when it is ready")
        fix = f"usermod -aG {group} $USER (then log in again)" if "permission" in str(exc) else None
        return Check(what, FAIL, str(exc), fix)
    owner = f"group {grp.getgrgid(st.st_gid).gr_name}" if _group_exists(st.st_gid) else f"gid {st.st_gid}"
    pid = answer.get("pid") if isinstance(answer, dict) else None
    named = answer.get("name", name) if isinstance(answer, dict) else name
    if named != name:
        return Check(what, FAIL, f"{path} answers as worker {named}", f"give workers.{name} a socket of its own")
    return Check(
        what,
        OK,
        f"{path} ({owner}, mode {stat.S_IMODE(st.st_mode):o}) answers" + (f": pid {pid}" if pid else "") + group_note,
        group_fix,
    )


def check_keys(cfg: WorkerConfig, ping: Callable[[str], Any] | None = None) -> Check:
    """API keys (docs/worker.md, "Accounts"): without them any client that reaches the worker may
    ask for turbo; with them, the file must load, and a Redis ledger should answer."""
    if not cfg.keys_file:
        return Check(
            "api keys",
            WARN,
            "no worker.keys_file: any client that reaches the worker can claim turbo (or any tier)",
            "turboctl keys add NAME --tier turbo --budget turbo=3600 --file /etc/turbonode/keys.toml, "
            "then set worker.keys_file (or authenticate at the balancer and set worker.trusted_proxies)",
        )
    try:
        keys = load_keys(cfg.keys_file, parse_period(cfg.budget_period))
    except ConfigError as exc:
        return Check("api keys", FAIL, str(exc), "fix the keys file: the worker does not start with it")
    revoked = sum(a.revoked for a in keys.by_name.values())
    detail = f"{len(keys)} keys ({revoked} revoked) in {cfg.keys_file}, ledger {cfg.ledger}"
    if any(ipaddress.ip_network(a, strict=False).prefixlen == 0 for a in cfg.trusted_proxies):
        return Check(
            "api keys",
            WARN,
            detail + "; worker.trusted_proxies trusts every address: any client can name an account or a tier",
            "list only the balancer's addresses in worker.trusted_proxies",
        )
    if cfg.ledger != "embedded":
        ping = ping or _redis_ping
        try:
            ping(cfg.ledger)
        except Exception as exc:  # noqa: BLE001 - any failure to reach it is the finding
            return Check(
                "api keys",
                WARN,
                f"{detail}; Redis does not answer ({type(exc).__name__}: {exc}): the worker serves on and "
                "judges budgets on what it last read",
                "start Redis (append-only), or check worker.ledger",
            )
    return Check("api keys", OK, detail)


def _redis_ping(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        client.ping()
    finally:
        client.close()


def _group_exists(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
        return True
    except KeyError:
        return False


# ---- all of it --------------------------------------------------------------------------------


def run_checks(cfg: Config, procfs: str = "/proc", sysfs: str = "/sys", modules: str = "/lib/modules") -> list[Check]:
    expect_gpu = gpu_expected(cfg)
    checks = [
        check_privileges(procfs),
        check_bpf_syscall(procfs=procfs),
        check_btf(sysfs),
        check_kernel_headers(modules),
        check_bcc() if os.geteuid() == 0 else Check("bcc", SKIP, "needs root to load a program"),
        check_mount("bpf", ("fs/bpf",), procfs, sysfs),
        check_mount("tracefs", ("kernel/tracing", "kernel/debug/tracing"), procfs, sysfs),
        check_softirq_tracepoints(sysfs),
        check_qdiscs(),
        check_interface(cfg.qos.dev, cfg.qos.netns, sysfs),
        check_psi(procfs, cfg.policy.psi_trigger_us),
        check_cgroups(procfs, sysfs),
        check_io_policy(cfg, procfs, sysfs),
        check_lever_writer(cfg, procfs),
        check_nvml(expect_gpu),
    ]
    facts = torch_facts()
    checks += [
        check_torch(facts, expect_gpu),
        check_tensorrt(cfg.worker.backend, bool(facts and facts["cuda_available"])),
        check_keys(cfg.worker),  # the node's keys file: [worker]'s, every worker's
    ]
    for spec in node_workers(cfg):  # each worker: its device, its GPU, its socket
        worker, _ = instance_worker(cfg, spec.name if cfg.workers else None)
        key = f"workers.{spec.name}.device" if cfg.workers else "worker.device"
        checks.append(check_device(worker.device, facts["devices"] if facts else 0, key))
        checks += [check_worker_gpu(spec.name, index) for index in spec.gpus or ()]
        checks.append(check_worker_socket(worker.control_socket, worker.control_group, name=spec.name))
    return checks


MARKS = {OK: "ok", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{MARKS[c.status]:<5} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<5} {'':<{width}}  -> {c.fix}")
    failed = sum(c.status == FAIL for c in checks)
    warned = sum(c.status == WARN for c in checks)
    lines.append("")
    lines.append(f"{len(checks)} checks: {failed} failed, {warned} warnings")
    return "\n".join(lines)


@click.command("doctor")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help=f"TOML configuration (default {DEFAULT_PATH} if present)",
)
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
def command(config_file: str | None, as_json: bool) -> None:
    """Check this host for what turbonode needs: privileges, eBPF, kernel headers, mounts, tracepoints,
    qdiscs, PSI, cgroups, GPU, torch, TensorRT, each worker's device, GPU and socket. Exits 1 when a check
    fails."""
    try:
        cfg = load_config(config_file)
        checks = [
            Check(
                "configuration",
                OK,
                f"{config_file or DEFAULT_PATH}: valid"
                + ("" if config_file or os.path.exists(DEFAULT_PATH) else " (absent: defaults)"),
            )
        ]
    except ConfigError as exc:
        cfg = Config()
        checks = [
            Check(
                "configuration",
                FAIL,
                f"invalid: {exc}",
                "`turboctl config check` names the bad key; the checks below use the defaults",
            )
        ]
    checks += run_checks(cfg, cfg.agent.procfs, cfg.agent.sysfs)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "checks": [asdict(c) for c in checks],
                    "failed": sum(c.status == FAIL for c in checks),
                    "warnings": sum(c.status == WARN for c in checks),
                },
                indent=2,
            )
        )
    else:
        click.echo(render(checks))
    if any(c.status == FAIL for c in checks):
        raise SystemExit(1)
