"""The agent's start on its device follows `turboctl qos apply`'s rules (issue 21): a filter an
administrator added on turbonode's root is deleted and logged, not a start that fails at every
restart; a missing capability (CAP_SYS_ADMIN to enter --netns, CAP_BPF/CAP_PERFMON for the
classifier) is named in one line before the device is touched. Real agent processes with their
capabilities cut by setpriv, on a real sandbox device."""

from __future__ import annotations

import shutil

import pytest

from bench.node import wait_for
from tests.helpers import ROOT, daemon_env, needs_bcc, start, stop, turboctl_argv

pytestmark = [needs_bcc, pytest.mark.root]
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")


def write_config(tmp_path, dev: str, netns: str | None) -> str:
    cfg = tmp_path / "agent.toml"
    ns = f'netns = "{netns}"\n' if netns else ""
    cfg.write_text(
        f'[qos]\ndev = "{dev}"\n{ns}rate = "100mbit"\n'
        f'[agent]\nsocket = "{tmp_path}/agent.sock"\nworker_socket = "{tmp_path}/no-worker.sock"\n'
        'metrics = "127.0.0.1:0"\nsample_period = 0.1\n'
    )
    return str(cfg)


def qdiscs(sandbox) -> str:
    return sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout


def filters(sandbox) -> str:
    return sandbox.run(sandbox.server, "tc", "filter", "show", "dev", sandbox.dev).stdout


def test_the_agent_starts_on_a_tree_with_an_administrators_filter(sandbox, tmp_path):
    from tc.datapath import Datapath

    dp = Datapath(sandbox.dev, sandbox.server)
    try:
        dp.apply()
        match = ("u32", "match", "ip", "dport", "22", "0xffff", "flowid", "1:40")
        add = ("tc", "filter", "add", "dev", sandbox.dev, "parent", "1:", "protocol", "ip", "prio", "9", *match)
        sandbox.run(sandbox.server, *add)
        proc, out = start(
            turboctl_argv("agent", "run", "--config", write_config(tmp_path, sandbox.dev, sandbox.server)), daemon_env()
        )
        try:
            assert wait_for(lambda: proc.poll() is not None or any("agent running" in x for x in out.lines), 60)
            assert proc.poll() is None, out.text
            assert out.wait_for(r"deleted filters turbonode does not define: u32 pref 9", 1), out.text
            assert "u32" not in filters(sandbox) and filters(sandbox).count("direct-action") == 1
        finally:
            rc = stop(proc)
        assert rc == 0, out.text
    finally:
        dp.remove()
        dp.close()


def run_agent(argv: list[str]) -> tuple[int, str]:
    proc, out = start(argv, daemon_env(), cwd=ROOT)
    try:
        proc.wait(60)
    finally:
        stop(proc)
    return proc.returncode, out.text


@needs_setpriv
def test_the_agent_names_cap_sys_admin_for_its_netns(sandbox, tmp_path):
    before = qdiscs(sandbox)
    config = write_config(tmp_path, sandbox.dev, sandbox.server)
    setpriv = ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"]
    rc, text = run_agent(setpriv + turboctl_argv("agent", "run", "--config", config))
    assert rc == 1, text
    assert f"Error: entering netns {sandbox.server} needs CAP_SYS_ADMIN, which" in text, text
    assert "seccomp" not in text
    assert qdiscs(sandbox) == before


# CAP_SYS_ADMIN grants both: it goes with each (a unit's CapabilityBoundingSet has none of it).
@needs_setpriv
@pytest.mark.parametrize(
    "drop, named",
    [
        ("-perfmon,-sys_admin", "CAP_PERFMON"),
        ("-bpf,-sys_admin", "CAP_BPF"),
        ("-bpf,-perfmon,-sys_admin", "CAP_BPF and CAP_PERFMON"),
    ],
    ids=["perfmon", "bpf", "both"],
)
def test_the_agent_names_the_classifiers_capability_and_leaves_the_device_alone(sandbox, tmp_path, drop, named):
    before = qdiscs(sandbox)
    config = write_config(tmp_path, sandbox.dev, None)
    # Inside the sandbox's namespace (no setns): `ip netns exec` gives a fresh /sys, bpffs is mounted there first.
    mount = "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf"
    script = f'{mount}; exec setpriv --inh-caps=-all --bounding-set={drop} "$@"'
    argv = sandbox.cmd(sandbox.server, "sh", "-c", script, "sh", *turboctl_argv("agent", "run", "--config", config))
    rc, text = run_agent(argv)
    assert rc == 1, text
    assert f"Error: loading the classifier on {sandbox.dev} needs {named}, which" in text, text
    assert "Permission denied" not in text
    assert qdiscs(sandbox) == before
