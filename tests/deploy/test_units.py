"""systemd/: the unit files, sysusers/tmpfiles entries and the example configuration.

systemd-analyze checks the units for real. It insists that ExecStart's binary exists, so each
unit is verified from a temporary copy whose install prefix (/opt/turbonode/.venv) points at
the venv running these tests, which has the same turboctl entry point.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers import ROOT
from turboctl import main
from turbonode.config import DEFAULT_PATH, Config, LeversConfig, load_config
from turbonode.config_example import render_example, toml_value

SYSTEMD = ROOT / "systemd"
DAEMONS = ("turbonode-agent.service", "turbonode-worker@.service")  # the worker: one instance per worker
MOUNTS = "turbonode-mounts.service"  # bpffs/tracefs for the agent, which Requires= it
WORKERS = "turbonode-workers.target"  # every worker instance; the agent is ordered after it
UNITS = (*DAEMONS, MOUNTS, WORKERS)
PREFIX = "/opt/turbonode/.venv/bin/"
# Exposure scores recorded in docs/service.md; a change that weakens the sandbox fails here.
MAX_EXPOSURE = {"turbonode-agent.service": 2.9, "turbonode-worker@.service": 1.7, MOUNTS: 3.7}

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (package systemd)"
)


def unit_sections(name: str) -> dict[str, dict[str, str]]:
    """The unit as section -> key -> value; repeated keys (DeviceAllow=) joined by newlines."""
    out: dict[str, dict[str, str]] = {}
    section = None
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section[key] = f"{section[key]}\n{value}" if key in section else value
    return out


def venv_bin() -> str:
    return os.path.dirname(sys.executable) + "/"


@pytest.fixture
def unit_dir(tmp_path):
    """Copies of the units with the install prefix pointing at this venv."""
    assert (Path(venv_bin()) / "turboctl").exists(), "turboctl not installed in the test venv (pip install -e .)"
    for name in UNITS:
        (tmp_path / name).write_text((SYSTEMD / name).read_text().replace(PREFIX, venv_bin()))
    return tmp_path


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60)


@needs_analyze
def test_units_verify_clean(unit_dir):
    # verify reads drop-ins next to the unit: check the old-kernel one with it
    (unit_dir / "turbonode-agent.service.d").mkdir()
    shutil.copy(SYSTEMD / "agent-cap-sys-admin.conf", unit_dir / "turbonode-agent.service.d/cap-sys-admin.conf")
    # verify exits 0 on unknown keys and bad values (it only warns), so any output is a failure.
    res = analyze("verify", *(str(unit_dir / u) for u in UNITS))
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res.stdout + res.stderr


@needs_analyze
def test_verify_catches_a_broken_unit(unit_dir):
    """The check above can fail: a typo'd key and a missing binary are both reported."""
    unit = unit_dir / UNITS[0]
    unit.write_text(
        unit.read_text().replace("NoNewPrivileges=", "NoNewPrivilege=").replace(venv_bin(), "/nonexistent/")
    )
    res = analyze("verify", str(unit))
    assert res.returncode != 0
    assert "Unknown key 'NoNewPrivilege'" in res.stderr and "/nonexistent/turboctl" in res.stderr


@needs_analyze
def test_an_instance_of_the_worker_template_verifies_clean(unit_dir):
    """What systemd starts: turbonode-worker@<name>.service, from the template beside it."""
    res = analyze("verify", str(unit_dir / "turbonode-worker@gpu0.service"))
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res.stdout + res.stderr


@needs_analyze
@pytest.mark.parametrize("name", MAX_EXPOSURE)
def test_security_exposure(unit_dir, name):
    res = analyze("security", "--offline=yes", "--no-pager", str(unit_dir / name))
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", res.stdout)
    assert m, res.stdout + res.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE[name], res.stdout
    assert f"{name}` | {m.group(1)}" in (ROOT / "docs/service.md").read_text(), "docs/service.md records another score"


def test_units_match_the_contracts():
    agent, worker = (unit_sections(u) for u in DAEMONS)
    cfg = Config()
    for unit, sub in ((agent, "agent"), (worker, "worker")):
        s = unit["Service"]
        assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
        instance = " --instance %i" if sub == "worker" else ""  # the template's instance is the worker's name
        assert s["ExecStart"] == f"{PREFIX}turboctl {sub} run --config {DEFAULT_PATH}{instance}"
        assert s["Restart"] == "on-failure"
        assert s["Group"] == cfg.worker.control_group
        assert s["ProtectSystem"] == "strict" and s["NoNewPrivileges"] == "yes"
    # both share /run/turbonode (the control socket's directory). Only the agent (root) owns it,
    # preserved on stop; the worker writes there without re-owning the tree (its own user would
    # take the agent's QoS locks from it at each start)
    a, w = agent["Service"], worker["Service"]
    run_dir = os.path.dirname(cfg.worker.control_socket)
    assert a["RuntimeDirectory"] == os.path.basename(run_dir)
    assert a["RuntimeDirectoryPreserve"] == "yes" and a["RuntimeDirectoryMode"] == "0770"
    assert "RuntimeDirectory" not in w and w["ReadWritePaths"] == run_dir
    caps = {"CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN", "CAP_SYS_RESOURCE"}
    assert set(a["AmbientCapabilities"].split()) == caps == set(a["CapabilityBoundingSet"].split())
    assert a["LimitMEMLOCK"] == "infinity" and a["WatchdogSec"]
    # neither daemon is the OOM killer's choice before batch work; the worker may mlock (memory_protect)
    assert a["OOMScoreAdjust"] == worker["Service"]["OOMScoreAdjust"] == str(LeversConfig().worker_oom_score_adj)
    assert worker["Service"]["LimitMEMLOCK"] == "infinity"
    # ProtectKernelTunables= makes /sys/fs/bpf read-only and wins over ReadWritePaths=/sys/fs/bpf
    # itself: only the pins' own directory is writable, made before the sandbox needs it ('-').
    assert a["ProtectKernelTunables"] == "yes" and a["ReadWritePaths"] == "-/sys/fs/bpf/turbonode"
    assert a["ExecStartPre"] == "+/bin/mkdir -p -m 0700 /sys/fs/bpf/turbonode"
    assert set(a["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # mounts come from a unit of their own: an ExecStartPre= mount is never seen by the main process
    assert agent["Unit"]["Requires"] == MOUNTS and MOUNTS in agent["Unit"]["After"].split()
    m = unit_sections(MOUNTS)["Service"]
    assert "mount -t bpf bpf /sys/fs/bpf" in m["ExecStart"] and "mount -t tracefs" in m["ExecStart"]
    assert m["Type"] == "oneshot" and m["RemainAfterExit"] == "yes"
    namespacing = {
        "ProtectSystem",
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectHome",
        "ProtectProc",
        "ReadWritePaths",
        "ReadOnlyPaths",
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "BindPaths",
        "PrivateNetwork",
        "RootDirectory",
        "MountFlags",
    }
    assert not namespacing & m.keys(), "its mounts would land in a namespace of its own"
    for unit in (agent, worker):
        # a unit failing at every start stops: Burst starts fit in the interval, each RestartSec apart
        # plus up to 4 x RestartSec to fail (systemd's default, 5 in 10 s, is never reached with 2 s)
        u, restart = unit["Unit"], float(unit["Service"]["RestartSec"].removesuffix("s"))
        interval = u["StartLimitIntervalSec"]
        seconds = float(interval.removesuffix("min")) * 60 if interval.endswith("min") else float(interval.rstrip("s"))
        assert int(u["StartLimitBurst"]) * restart * 5 <= seconds, u
    assert "ProtectKernelModules" not in a, "hides /lib/modules, where bcc finds kernel headers"
    assert "ProtectControlGroups" not in a, "the cpu_share lever writes cgroup CPU weights and quotas"
    w = worker["Service"]
    assert w["User"] == "turbonode-worker" and w["KillSignal"] == "SIGTERM"
    # systemd must wait out the worker's own drain before it sends SIGKILL
    assert float(w["TimeoutStopSec"].removesuffix("s")) > cfg.worker.drain_timeout
    assert w["CapabilityBoundingSet"] == "" and w["DevicePolicy"] == "closed"
    assert "char-nvidia-frontend rw" in w["DeviceAllow"].splitlines()
    assert "PrivateDevices" not in w, "would hide /dev/nvidia*"
    # every worker (an enabled instance) is part of the target the agent is ordered after; any may
    # fail without failing the agent (Wants=, never Requires=/BindsTo=)
    assert WORKERS in agent["Unit"]["After"].split() and WORKERS in agent["Unit"]["Wants"].split()
    assert not {"Requires", "BindsTo", "Requisite"} & {k for k, v in agent["Unit"].items() if WORKERS in v}
    assert worker["Unit"]["PartOf"] == WORKERS and WORKERS in worker["Install"]["WantedBy"].split()
    assert "turbonode-agent.service" not in worker["Unit"].get("After", "")  # the agent comes after, not before
    assert unit_sections(WORKERS)["Install"]["WantedBy"] == "multi-user.target"
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in w["Environment"]  # cuda:N is nvidia-smi's N, the config's gpu
    dropin = unit_sections("agent-cap-sys-admin.conf")["Service"]
    assert dropin["CapabilityBoundingSet"] == dropin["AmbientCapabilities"] == "CAP_SYS_ADMIN"


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="systemd-sysusers/systemd-tmpfiles not installed",
)
@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles --root chowns: needs root")
def test_sysusers_and_tmpfiles_in_a_scratch_root(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    res = subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(SYSTEMD / "turbonode.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    users = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (root / "etc/group").read_text().splitlines()}
    assert {"turbonode", "video", "render"} <= groups.keys()
    worker = users["turbonode-worker"]
    assert worker[3] == groups["turbonode"][2] and worker[6] == "/usr/sbin/nologin"
    res = subprocess.run(
        ["systemd-tmpfiles", f"--root={root}", "--create", str(SYSTEMD / "turbonode.tmpfiles.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    st = (root / "run/turbonode").stat()
    assert oct(st.st_mode & 0o7777) == "0o770" and st.st_uid == 0 and str(st.st_gid) == groups["turbonode"][2]
    st = (root / "var/cache/turbonode").stat()
    assert str(st.st_uid) == worker[2]


def _missing_and_unknown(obj, table, prefix=""):
    """Config fields absent from the TOML table, and TOML keys that are no config field."""
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    missing = [prefix + k for k in fields if k not in table]
    unknown = [prefix + k for k in table if k not in fields]
    for k, value in fields.items():
        if dataclasses.is_dataclass(value) and k in table:
            m, u = _missing_and_unknown(value, table[k], f"{prefix}{k}.")
            missing += m
            unknown += u
    return missing, unknown


def test_example_config_is_generated_complete_and_loads():
    path = SYSTEMD / "turbonode.toml.example"
    text = path.read_text()
    assert text == render_example(), "systemd/turbonode.toml.example is stale: turboctl config example > it"
    # no [workers.<name>] by default (one worker, `default`): the table is shown commented out
    assert _missing_and_unknown(Config(), tomllib.loads(text)) == (["workers"], [])
    assert "\n# [workers.gpu0]\n" in text
    assert load_config(str(path), env={}) == Config()


def test_example_renders_non_defaults_that_load_back():
    cfg = load_config(
        None,
        env={},
        overrides={
            "qos.dscp": {"10": "relax"},
            "qos.rate": "100mbit",
            "agent.dry_run": True,
            "worker.min_share": 0.25,
            "workers.gpu1": {"gpu": 1, "cpus": "2-3"},
        },
    )
    data = tomllib.loads(render_example(cfg))
    assert data["qos"]["dscp"] == {"10": "relax"} and data["agent"]["dry_run"] is True
    assert data["workers"]["gpu1"]["gpu"] == 1 and data["workers"]["gpu1"]["cpus"] == "2-3"
    assert toml_value('a "b"\n') == r'"a \"b\"\n"' and toml_value([1, 2.5]) == "[1, 2.5]"


def test_cli_config_example(tmp_path):
    res = CliRunner().invoke(main, ["config", "example"])
    assert res.exit_code == 0 and res.output == render_example()
    f = tmp_path / "t.toml"
    f.write_text(res.output.replace("max_batch = 4", "max_batch = 0"))
    res = CliRunner().invoke(main, ["config", "check", str(f)])
    assert res.exit_code == 1 and "worker.max_batch" in res.output
