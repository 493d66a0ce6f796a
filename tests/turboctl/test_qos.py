"""`turboctl qos ...` through click's CliRunner, against a real sandbox interface."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tests.helpers import ROOT, daemon_env, needs_bcc, turboctl_argv
from turboctl import main


def run(*args):
    res = CliRunner().invoke(main, ["qos", *args])
    assert "Traceback" not in res.output
    return res


@pytest.fixture
def target(sandbox):
    yield ["--dev", sandbox.dev, "--netns", sandbox.server]
    run("remove", "--dev", sandbox.dev, "--netns", sandbox.server)


@needs_bcc
def test_qos_commands_end_to_end(sandbox, target, tmp_path):
    res = run("apply", *target, "--rate", "100mbit")
    assert res.exit_code == 0, res.output
    assert "13 change(s); classifier compiled and attached" in res.output
    res = run("apply", *target, "--rate", "100mbit")
    assert res.exit_code == 0 and "0 change(s); classifier already current" in res.output

    sandbox.run(sandbox.server, "ping", "-c", "3", "-i", "0.05", "-Q", "0xb8", sandbox.client_ip)
    res = run("show", *target)
    assert res.exit_code == 0, res.output
    lines = {line.split()[0]: line.split() for line in res.output.splitlines() if line}
    assert lines["tier"][:5] == ["tier", "class", "dscp", "packets", "bytes"]
    assert lines["turbo"][1:4] == ["1:10", "46", "3"] and lines["turbo"][-2:] == ["90mbit", "100mbit"]
    assert lines["fast"][2] == "34,36,38" and lines["relax"][2] == "1,8"
    assert "limit: relax none in force" in res.output

    from tc.datapath import Datapath

    with Datapath(sandbox.dev, sandbox.server) as dp:  # what the agent does under degradation
        dp.limit("relax", 20_000_000, 30.0)
    res = run("show", *target)
    lines = {line.split()[0]: line.split() for line in res.output.splitlines() if line}
    assert lines["relax"][-1] == "20mbit"  # the ceiling in force
    limit = next(line for line in res.output.splitlines() if line.startswith("limit:"))
    assert re.fullmatch(
        r"limit: relax ceil 20mbit in force until \d\d:\d\d:\d\d \((29|30)\.\d s left unless the agent renews it; "
        r"class 1:41\)",
        limit,
    ), limit

    view = json.loads(run("show", *target, "--json").output)
    assert view["rate_bps"] == 100_000_000 and view["tiers"]["turbo"]["packets"] == 3
    assert set(view["tiers"]) == {"turbo", "fast", "other", "relax", "unparsed"}
    assert {"htb_sent_bytes", "drops", "backlog_bytes", "borrowed"} <= set(view["tiers"]["turbo"])

    res = run("set-map", *target, "10=fast", "0=relax")
    assert res.exit_code == 0 and "DSCP 10 -> fast, DSCP 0 -> relax" in res.output
    view = json.loads(run("show", *target, "--json").output)
    assert view["tiers"]["relax"]["dscp"] == [0, 1, 8] and 10 in view["tiers"]["fast"]["dscp"]

    res = run("set-rate", *target, "relax", "5mbit", "20mbit")
    assert res.exit_code == 0 and "relax rate 5mbit ceil 20mbit" in res.output
    view = json.loads(run("show", *target, "--json").output)
    assert (view["tiers"]["relax"]["rate_bps"], view["tiers"]["relax"]["ceil_bps"]) == (5_000_000, 20_000_000)

    cfg = tmp_path / "t.toml"
    cfg.write_text('[qos]\nrate = "50mbit"\nleaf_limit = 200\n[qos.dscp]\n10 = "turbo"\n')
    res = run("apply", *target, "--config", str(cfg))
    assert res.exit_code == 0, res.output
    view = json.loads(run("show", *target, "--json").output)
    assert view["rate_bps"] == 50_000_000 and 10 in view["tiers"]["turbo"]["dscp"]

    res = run("remove", *target)
    assert res.exit_code == 0 and "removed; root qdisc is noqueue again" in res.output
    res = run("show", *target)
    assert res.exit_code == 1 and "no turbonode QoS on" in res.output and "qos apply" in res.output


@needs_bcc
def test_an_administrators_filter_on_the_root_is_deleted_and_named(sandbox, target):
    """Issue 21: after `tc filter add ... parent 1: ... u32 ...` every apply failed at read-back
    with a Python repr. Apply deletes it like a hand-made class and says so in one line."""
    assert run("apply", *target).exit_code == 0
    match = ("u32", "match", "ip", "dport", "22", "0xffff", "flowid", "1:40")
    tc_add = ("tc", "filter", "add", "dev", sandbox.dev, "parent", "1:", "protocol", "ip", "prio", "9", *match)
    sandbox.run(sandbox.server, *tc_add)
    res = run("apply", *target)
    assert res.exit_code == 0, res.output
    assert f"{sandbox.dev}: deleted filters turbonode does not define: u32 pref 9" in res.output, res.output
    assert "FilterState" not in res.output
    shown = sandbox.run(sandbox.server, "tc", "filter", "show", "dev", sandbox.dev).stdout
    assert "u32" not in shown and shown.count("direct-action") == 1, shown
    assert "0 change(s)" in run("apply", *target).output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["apply", "--rate", "10furlong"], 2, "bad rate '10furlong': unknown unit 'furlong'"),
        (["apply", "--rate", "0mbit"], 2, "must be positive"),
        (["set-map", "64=turbo"], 2, "expected DSCP=TIER with DSCP 0..63"),
        (["set-map", "46=gold"], 2, "unknown tier 'gold'"),
        (["set-map", "46"], 2, "expected DSCP=TIER"),
        (["set-rate", "gold", "1mbit"], 2, "'gold' is not one of"),
        (["set-rate", "relax", "fast"], 2, "bad rate 'fast'"),
    ],
)
def test_bad_arguments_are_named(args, code, message):
    res = run(*args, "--dev", "eth-unused")
    assert res.exit_code == code and message in res.output, res.output


def test_missing_dev_and_bad_config(tmp_path):
    res = run("show", "--config", str(tmp_path / "none.toml"))
    assert res.exit_code == 1 and "file not found" in res.output
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    res = run("show", "--config", str(empty))
    assert res.exit_code == 2 and "no interface: pass --dev" in res.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[qos]\nrate = "fast"\n')
    res = run("apply", "--dev", "x", "--config", str(bad))
    assert res.exit_code == 1 and "qos.rate" in res.output


def test_unknown_device_and_namespace(sandbox):
    res = run("apply", "--dev", "nosuchdev0", "--netns", sandbox.server)
    assert res.exit_code == 1 and f"unknown device nosuchdev0 in netns {sandbox.server}" in res.output
    res = run("show", "--dev", sandbox.dev, "--netns", "tn-no-such-ns")
    assert res.exit_code == 1 and "unknown network namespace 'tn-no-such-ns'" in res.output
    assert not os.path.exists("/run/netns/tn-no-such-ns")  # opening it must not create it


NOBODY = 65534


def turboctl_with_caps(sandbox, privileges: list[str], *args: str) -> subprocess.CompletedProcess:
    """`turboctl ARGS` inside the sandbox node with its privileges cut by setpriv, as a unit's
    CapabilityBoundingSet or User= would cut them (tests/test_daemons.py does the same)."""
    # `ip netns exec` gives a fresh /sys: bpffs is mounted there first, as the unit's host has it.
    script = 'mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf; exec setpriv --inh-caps=-all "$@"'
    argv = sandbox.cmd(sandbox.server, "sh", "-c", script, "sh", *privileges, *turboctl_argv(*args))
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=daemon_env(), cwd=ROOT)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
@pytest.mark.parametrize(
    "privileges",
    [
        ["--bounding-set=-net_admin"],  # root, but not allowed tc
        [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--bounding-set=-all"],  # not root
    ],
    ids=["root-without-net-admin", "unprivileged-user"],
)
def test_missing_net_admin_is_named(sandbox, privileges):
    res = turboctl_with_caps(sandbox, privileges, "qos", "apply", "--dev", sandbox.dev)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"tc on {sandbox.dev} needs CAP_NET_ADMIN, which this process does not have" in res.stderr, res.stderr
    assert "needs root" not in res.stderr


# CAP_SYS_ADMIN grants CAP_BPF and CAP_PERFMON too: it goes with each of them; CAP_NET_ADMIN stays.
# The classifier needs CAP_PERFMON besides CAP_BPF: without it the verifier refuses its packet
# pointer arithmetic ("pointer arithmetic with it prohibited for !root", EACCES).
CLASSIFIER_CAPS = [
    ("-bpf,-sys_admin", "CAP_BPF"),
    ("-perfmon,-sys_admin", "CAP_PERFMON"),
    ("-bpf,-perfmon,-sys_admin", "CAP_BPF and CAP_PERFMON"),
]


@needs_bcc
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
@pytest.mark.parametrize("drop, named", CLASSIFIER_CAPS, ids=["bpf", "perfmon", "both"])
def test_missing_classifier_caps_are_named_before_anything_changes(sandbox, drop, named):
    before = sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout
    res = turboctl_with_caps(sandbox, [f"--bounding-set={drop}"], "qos", "apply", "--dev", sandbox.dev)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.startswith(f"Error: loading the classifier on {sandbox.dev} needs {named}, which"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout == before


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_entering_a_netns_without_cap_sys_admin_is_named(sandbox):
    """Issue 21: setns() into --netns needs CAP_SYS_ADMIN; the error blamed seccomp or an LSM."""
    before = sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout
    argv = ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"]
    argv += turboctl_argv("qos", "apply", "--dev", sandbox.dev, "--netns", sandbox.server)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=daemon_env(), cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"Error: entering netns {sandbox.server} needs CAP_SYS_ADMIN, which" in res.stderr, res.stderr
    assert "seccomp" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout == before


@needs_bcc
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_the_softirq_probes_name_cap_bpf():
    from agent.watchers.softirq import missing_tracepoints

    if missing_tracepoints():
        pytest.skip("tracefs or the irq tracepoints are missing here: the probes stop before the capability check")
    probe = "from agent.watchers.softirq import SoftirqWatcher as W; print(W().bpf_error)"
    argv = ["setpriv", "--inh-caps=-all", "--bounding-set=-bpf,-sys_admin", sys.executable, "-c", probe]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert "loading the softirq tracepoint probes needs CAP_BPF" in res.stdout, res.stdout + res.stderr


FAKE_BCC = {
    "missing": "raise ImportError('No module named bcc')\n",
    "headers": (
        "import sys\nclass BPF:\n    SCHED_CLS = 3\n    def __init__(self, **kw):\n"
        "        print('Unable to find kernel headers. Try rebuilding kernel with CONFIG_IKHEADERS=m',"
        " file=sys.stderr)\n        raise Exception('Failed to compile BPF module')\n"
    ),
}


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "bcc Python bindings not importable: install python3-bpfcc"),
        ("headers", "no kernel headers for bcc: install linux-headers-$(uname -r)"),
    ],
)
def test_no_bcc_and_no_headers_are_named_and_rolled_back(sandbox, tmp_path, monkeypatch, case, message):
    """A classifier that cannot be built fails apply after it replaced the root: the root it made
    goes again (issue 21: `htb 1:` stayed), the kernel's own is back and the pins are gone."""
    from tc.reconcile import places

    # A stand-in bcc package on the loader child's path reproduces a host without bcc or headers.
    (tmp_path / "bcc").mkdir()
    (tmp_path / "bcc" / "__init__.py").write_text(FAKE_BCC[case])
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    before = sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout
    res = run("apply", "--dev", sandbox.dev, "--netns", sandbox.server)
    after = sandbox.run(sandbox.server, "tc", "qdisc", "show", "dev", sandbox.dev).stdout
    run("remove", "--dev", sandbox.dev, "--netns", sandbox.server)
    assert res.exit_code == 1 and message in res.output, res.output
    assert "; rolled back: the root qdisc is noqueue again" in res.output, res.output
    assert after == before
    assert not os.path.exists(places(sandbox.dev, sandbox.server).pin_dir)


@needs_bcc
def test_remove_after_the_namespace_is_gone_cleans_and_says_so(sandbox):
    assert run("apply", "--dev", sandbox.dev, "--netns", sandbox.server).exit_code == 0
    sandbox.delete()
    res = run("remove", "--dev", sandbox.dev, "--netns", sandbox.server)
    assert res.exit_code == 0, res.output
    assert f"cleaned the pins of deleted namespaces or devices: {sandbox.server}/{sandbox.dev}" in res.output
    res = run("remove", "--dev", sandbox.dev, "--netns", sandbox.server)
    assert res.exit_code == 1 and "unknown network namespace" in res.output
