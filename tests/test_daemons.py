"""The daemons as systemd runs them: real subprocesses, a test NOTIFY_SOCKET and WATCHDOG_USEC,
SIGTERM, and a bad configuration refused at start with the key named."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from sandbox.loadgen import request_image
from tests.helpers import (
    PROMTOOL_SKIP,
    ROOT,
    NotifyListener,
    daemon_env,
    needs_bcc,
    promtool_check,
    scrape,
    start,
    stop,
    turboctl_argv,
)
from turbonode.jsonrpc import ControlClient

WATCHDOG_USEC = 400_000  # the daemon must ping every 0.2 s


@pytest.fixture
def notify(tmp_path):
    listener = NotifyListener(tmp_path)
    yield listener
    listener.close()


def root_qdisc(sandbox) -> str:
    return sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev, "root").stdout


@pytest.mark.parametrize(
    "daemon,bad,key",
    [
        ("agent", "[agent]\nsample_period = -1\n", "agent.sample_period"),
        ("agent", '[qos]\nrate = "fast"\n', "qos.rate"),
        ("worker", "[worker]\nmax_batch = 0\n", "worker.max_batch"),
        ("worker", '[worker]\nlisten = "nowhere"\n', "worker.listen"),
    ],
)
def test_bad_config_refused_at_start(tmp_path, notify, daemon, bad, key):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(bad)
    proc, out = start(turboctl_argv(daemon, "run", "--config", str(cfg)), daemon_env(notify))
    rc = proc.wait(60)
    assert rc != 0 and key in out.text, out.text
    assert not notify.wait_for("READY=1", 0.1)


def _agent_config(tmp_path, sandbox, keep_on_stop: bool):
    cfg = tmp_path / f"agent-{keep_on_stop}.toml"
    cfg.write_text(f"""
[qos]
dev = "{sandbox.dev}"
netns = "{sandbox.server}"
rate = "100mbit"
keep_on_stop = {str(keep_on_stop).lower()}
[agent]
socket = "{tmp_path}/agent.sock"
worker_socket = "{tmp_path}/no-worker.sock"
metrics = "127.0.0.1:0"
sample_period = 0.1
""")
    return cfg


@needs_bcc
@pytest.mark.slow
def test_agent_daemon_notify_metrics_and_fail_static(sandbox, tmp_path, notify):
    try:
        for round_, keep in enumerate((True, False), 1):
            cfg = _agent_config(tmp_path, sandbox, keep)
            proc, out = start(
                turboctl_argv("-v", "agent", "run", "--config", str(cfg)), daemon_env(notify, WATCHDOG_USEC)
            )
            try:
                ready = notify.wait_for("READY=1", 90, count=round_, proc=proc)
                assert ready, out.text
                assert notify.wait_for("WATCHDOG=1", 5, count=notify.messages.count("WATCHDOG=1") + 3, proc=proc)
                assert "htb" in root_qdisc(sandbox)
                m = out.wait_for(r"metrics on [\d.]+:(\d+)/metrics", 5)
                assert m, out.text
                text = scrape(f"http://127.0.0.1:{m.group(1)}/metrics")
                assert re.search(
                    r'^turbonode_degradation_level\{node="[^"]+",worker="default"\} [0-3]\.0$', text, re.M
                ), text
                assert re.search(r'^turbonode_tier_packets_total\{node="[^"]+",tier="turbo"\} ', text, re.M), text
                if keep and not PROMTOOL_SKIP:
                    res = promtool_check(text)
                    assert res.returncode == 0, res.stdout + res.stderr
            finally:
                rc = stop(proc, 30)
            assert rc == 0, out.text
            assert notify.wait_for("STOPPING=1", 1, count=round_), notify.messages
            # fail-static: the datapath stays unless qos.keep_on_stop = false
            assert ("htb" in root_qdisc(sandbox)) is keep, root_qdisc(sandbox)
    finally:
        subprocess.run(
            turboctl_argv("qos", "remove", "--dev", sandbox.dev, "--netns", sandbox.server),
            env=daemon_env(),
            capture_output=True,
            timeout=60,
        )


NOBODY = 65534


@pytest.fixture
def worker_dir():
    """A directory the worker can write as an unprivileged user (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="tn-worker-"))
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_worker_daemon_notify_metrics_and_sigterm_drain(worker_dir):
    """As the unit runs it: its own unprivileged user, no capabilities, no new privileges."""
    sock = worker_dir / "worker.sock"
    cfg = worker_dir / "worker.toml"
    # drain_timeout shorter than the long job below: SIGTERM must fail it with a clear error
    cfg.write_text(f"""
[worker]
listen = "127.0.0.1:0"
control_socket = "{sock}"
model = "tiny"
device = "cpu"
size = 64
drain_timeout = 1.0
""")
    notify = NotifyListener(worker_dir)
    os.chmod(notify.path, 0o666)  # systemd's socket accepts every service user
    argv = turboctl_argv("worker", "run", "--config", str(cfg))
    if os.geteuid() == 0:
        argv = [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            *argv,
        ]
    env = daemon_env(notify, WATCHDOG_USEC, HOME=str(worker_dir), XDG_CACHE_HOME=str(worker_dir / "cache"))
    proc, out = start(argv, env)
    try:
        assert notify.wait_for("READY=1", 180, proc=proc), out.text
        assert notify.wait_for("WATCHDOG=1", 5, count=3, proc=proc), notify.messages
        url = out.wait_for(r"serving (http://\S+)", 5).group(1)
        if os.geteuid() == 0:
            st = Path(f"/proc/{proc.pid}/status").read_text()
            assert re.search(rf"^Uid:\s+{NOBODY}\s", st, re.M) and re.search(r"^CapBnd:\s+0+$", st, re.M), st
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660  # the units' group access relies on it
        assert ControlClient(str(sock)).call("ping")
        assert request_image(url, "turbo", size=64, steps=2).status == 200
        text = scrape(url + "/metrics")
        assert re.search(
            r'^turbonode_worker_jobs_total\{node="[^"]+",outcome="\w+",tier="turbo",worker="default"\} 1\.0$',
            text,
            re.M,
        ), text
        if not PROMTOOL_SKIP:
            res = promtool_check(text)
            assert res.returncode == 0, res.stdout + res.stderr

        long_job = []
        t = threading.Thread(target=lambda: long_job.append(request_image(url, "relax", size=256, steps=200)))
        t.start()
        client = ControlClient(str(sock))
        for _ in range(100):  # until the job is denoising
            if client.call("status")["tiers"]["relax"]["in_flight"]:
                break
            threading.Event().wait(0.1)
        else:
            pytest.fail("the long job never started")
    finally:
        rc = stop(proc, 60)
    t.join(30)
    assert rc == 0, out.text
    assert notify.wait_for("STOPPING=1", 1), notify.messages
    assert long_job[0].status == 503 and "stopped before the job finished" in long_job[0].error, long_job
    assert request_image(url, "turbo", timeout=5).status == 0  # nothing listens any more
    assert not sock.exists()
    notify.close()


# Bit numbers of the capabilities turbonode-agent.service grants (linux/capability.h).
CAP_BITS = {"CAP_NET_ADMIN": 12, "CAP_SYS_RESOURCE": 24, "CAP_PERFMON": 38, "CAP_BPF": 39}


def _unit_caps() -> list[str]:
    text = (ROOT / "systemd/turbonode-agent.service").read_text()
    return re.search(r"^AmbientCapabilities=(.*)$", text, re.M).group(1).split()


@needs_bcc
@pytest.mark.slow
def test_agent_runs_with_only_the_units_capabilities(sandbox, tmp_path, notify):
    """What systemd does, done by hand: mount bpffs/tracefs with full privileges (ExecStartPre=+),
    then start the agent with the unit's capability bounding set and nothing else: no
    CAP_SYS_ADMIN, no CAP_DAC_OVERRIDE. It must load its eBPF programs and shape the device."""
    have = int(re.search(r"^CapBnd:\s*(\w+)", Path("/proc/self/status").read_text(), re.M).group(1), 16)
    caps = [c for c in _unit_caps() if have >> CAP_BITS[c] & 1]  # this VM has no CAP_SYS_RESOURCE at all
    if not {"CAP_BPF", "CAP_PERFMON"} <= set(caps):
        pytest.skip("kernel without CAP_BPF/CAP_PERFMON (< 5.8): the unit needs the CAP_SYS_ADMIN drop-in there")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[qos]\ndev = "{sandbox.dev}"\nrate = "100mbit"\nkeep_on_stop = false\n'
        f'[agent]\nsocket = "{tmp_path}/agent.sock"\nworker_socket = "{tmp_path}/none.sock"\n'
        f'metrics = "127.0.0.1:0"\nsample_period = 0.1\n'
    )
    bounding = ",".join(["-all"] + ["+" + c.removeprefix("CAP_").lower() for c in caps])
    # `ip netns exec` gives the agent the node's namespace and a fresh /sys without bpffs/tracefs:
    # mounting them there is the unit's ExecStartPre.
    script = (
        "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf; "
        "mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing; "
        f'exec setpriv --bounding-set={bounding} --inh-caps=-all "$@"'
    )
    argv = sandbox.cmd(
        sandbox.server, "sh", "-c", script, "sh", *turboctl_argv("-v", "agent", "run", "--config", str(cfg))
    )
    proc, out = start(argv, daemon_env(notify, WATCHDOG_USEC))
    try:
        assert notify.wait_for("READY=1", 90, proc=proc), out.text
        status = ControlClient(f"{tmp_path}/agent.sock", peer="agent").call("status")
        assert status["watchers"]["softirq"]["ok"] and status["watchers"]["htb"]["ok"], status["watchers"]
        assert "htb" in root_qdisc(sandbox)
        assert re.search(
            rf"^CapBnd:\s*0*{sum(1 << CAP_BITS[c] for c in caps):x}$",
            Path(f"/proc/{proc.pid}/status").read_text(),
            re.M,
        )
    finally:
        rc = stop(proc, 30)
    assert rc == 0, out.text
    assert "htb" not in root_qdisc(sandbox)  # keep_on_stop = false: removed, with only these capabilities
