"""Apply reconciles from what the kernel holds, not from a remembered file (issue 10, section 2):
a lost /run, a root somebody else made, classes added by hand, a deleted namespace or device,
and kill -9 at any moment of apply. Real kernel, real sandbox namespaces."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers import ROOT, needs_bcc

pytestmark = [needs_bcc, pytest.mark.root]

RATE = 100_000_000


def tc(sb, *args: str, dev: str | None = None) -> str:
    argv = ["tc", "-n", sb.server, *args, "dev", dev or sb.dev]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def tc_do(sb, *args: str) -> None:
    subprocess.run(["tc", "-n", sb.server, *args], capture_output=True, text=True, check=True)


def leaf_kinds(sb) -> set[str]:
    """Kinds of the qdiscs under the tier classes, as `tc` reports them."""
    return {line.split()[1] for line in tc(sb, "qdisc", "show").splitlines() if " parent 1:" in line}


@pytest.fixture
def make(sandbox, tmp_path):
    """Datapath objects on the sandbox device with a private runtime directory; removed after."""
    from tc.datapath import Datapath

    made = []

    def _make(dev: str | None = None, netns: str | None = None) -> Datapath:
        dp = Datapath(dev or sandbox.dev, netns or sandbox.server, run_dir=str(tmp_path / "run"))
        made.append(dp)
        return dp

    yield _make
    for dp in made:
        try:
            dp.remove()
        except Exception:  # the device may be gone: the test said what it expected
            pass
        dp.close()


def test_a_lost_runtime_dir_never_records_a_leaf_kind_the_kernel_lacks(sandbox, tmp_path, make):
    """The issue's repro: apply; lose /run/turbonode/qos; apply; apply. The leaf kind comes from
    the kernel, so every apply succeeds and `show` names the leaves the kernel really has."""
    dp = make()
    first = dp.apply(rate_bps=RATE)
    kernel_kind = leaf_kinds(sandbox)
    assert kernel_kind == {first["leaf_kind"]}
    shutil.rmtree(tmp_path / "run" / "qos")
    for _ in range(2):
        again = dp.apply(rate_bps=RATE)
        assert again["leaf_kind"] == first["leaf_kind"]
    assert leaf_kinds(sandbox) == kernel_kind
    assert dp.show()["leaf_kind"] == first["leaf_kind"]


def test_an_administrators_htb_root_is_never_taken_over_or_removed(sandbox, make):
    """After our tree is replaced by somebody's own `htb 1:` (whatever /run still says), apply
    refuses it untouched and remove leaves it in place."""
    dp = make()
    dp.apply(rate_bps=RATE)
    tc_do(sandbox, "qdisc", "del", "dev", sandbox.dev, "root")
    tc_do(sandbox, "qdisc", "add", "dev", sandbox.dev, "root", "handle", "1:", "htb", "default", "30")
    tc_do(sandbox, "class", "add", "dev", sandbox.dev, "parent", "1:", "classid", "1:30", "htb", "rate", "7mbit")
    theirs = (tc(sandbox, "qdisc", "show"), tc(sandbox, "class", "show"))
    from turbonode.errors import DatapathError

    with pytest.raises(DatapathError, match="htb 1:0 that turbonode did not create"):
        dp.apply(rate_bps=RATE)
    assert (tc(sandbox, "qdisc", "show"), tc(sandbox, "class", "show")) == theirs
    assert dp.remove()["removed"] is False
    assert (tc(sandbox, "qdisc", "show"), tc(sandbox, "class", "show")) == theirs
    with pytest.raises(DatapathError, match="no turbonode QoS"):
        dp.set_rate("relax", 1_000_000)
    assert tc(sandbox, "class", "show") == theirs[1]
    tc_do(sandbox, "qdisc", "del", "dev", sandbox.dev, "root")


def test_classes_added_by_hand_inside_the_tree_are_reconciled_away(sandbox, make):
    """Apply owns the tree under 1:: an extra class beside the tiers, one under a tier (which
    turns the tier into an inner class) and a qdisc under it are removed, and reported."""
    dp = make()
    dp.apply(rate_bps=RATE)
    want = sorted(tc(sandbox, "class", "show").splitlines())
    tc_do(sandbox, "class", "add", "dev", sandbox.dev, "parent", "1:1", "classid", "1:50", "htb", "rate", "1mbit")
    tc_do(sandbox, "qdisc", "add", "dev", sandbox.dev, "parent", "1:50", "handle", "50:", "pfifo", "limit", "5")
    tc_do(sandbox, "class", "add", "dev", sandbox.dev, "parent", "1:10", "classid", "1:51", "htb", "rate", "1mbit")
    tc_do(sandbox, "class", "add", "dev", sandbox.dev, "parent", "1:51", "classid", "1:52", "htb", "rate", "1mbit")
    again = dp.apply(rate_bps=RATE)
    assert again["extra_classes"] == ["1:50", "1:51", "1:52"]
    assert sorted(tc(sandbox, "class", "show").splitlines()) == want
    assert "leaf 10:" in tc(sandbox, "class", "show")  # turbo is a leaf class with its queue again
    assert dp.apply(rate_bps=RATE)["changes"] == 0


def u32_ssh_to_relax(sb, *where: str) -> None:
    """An administrator's own filter on our root: ssh to relax (issue 21's repro)."""
    match = ("u32", "match", "ip", "dport", "22", "0xffff", "flowid", "1:40")
    tc_do(sb, "filter", "add", "dev", sb.dev, "parent", "1:", *where, "protocol", "ip", *match)


def test_filters_added_by_hand_under_the_root_are_reconciled_away(sandbox, make):
    """Issue 21: a filter somebody added on 1: wedged every later apply at read-back. Apply owns
    the filters of 1: as it owns its classes: u32 filters at another prio, in another chain, a
    bpf filter beside ours at our prio are deleted and reported; our classifier stays attached."""
    dp = make()
    first = dp.apply(rate_bps=RATE)
    ours = tc(sandbox, "filter", "show")
    u32_ssh_to_relax(sandbox, "prio", "9")
    u32_ssh_to_relax(sandbox, "chain", "5", "prio", "3")
    # Classic BPF in our own prio: cls_bpf runs its newest program first, so it would run before ours.
    bpf = ("bpf", "bytecode", "1,6 0 0 0,", "classid", "1:40")
    tc_do(
        sandbox,
        "filter",
        "add",
        "dev",
        sandbox.dev,
        "parent",
        "1:",
        "protocol",
        "all",
        "prio",
        "1",
        "handle",
        "2",
        *bpf,
    )
    assert dp.plan(rate_bps=RATE) == [
        "delete filter bpf pref 1 handle 0x2 (not turbonode's)",
        "delete filter u32 pref 9 (not turbonode's)",
        "delete filter u32 pref 3 chain 5 (not turbonode's)",
    ]
    again = dp.apply(rate_bps=RATE)
    assert again["extra_filters"] == ["bpf pref 1 handle 0x2", "u32 pref 9", "u32 pref 3 chain 5"], again
    assert again["changes"] == 3 and not again["compiled"] and again["prog_id"] == first["prog_id"]
    assert tc(sandbox, "filter", "show") == ours
    assert dp.apply(rate_bps=RATE)["changes"] == 0


def test_remove_after_the_namespace_is_deleted_cleans_and_reports(sandbox, tmp_path, make):
    from sandbox.netns import Sandbox

    dp = make()
    dp.apply(rate_bps=RATE)
    assert os.path.isdir(dp.places.pin_dir)
    sandbox.delete()  # the namespace and the device go; the kernel drops the tree with them
    result = dp.remove()
    assert result["removed"] is False and result["stale"], result
    assert not os.path.exists(dp.places.pin_dir) and not os.path.exists(dp.places.lock_file)
    assert not os.path.exists(os.path.dirname(dp.places.lock_file))
    from turbonode.errors import NoDeviceError

    with pytest.raises(NoDeviceError, match="unknown network namespace"):  # nothing left to clean
        dp.remove()

    # Another namespace's apply sweeps what a deleted namespace left behind, and says so.
    with Sandbox() as gone, Sandbox() as other:
        left = make(gone.dev, gone.server)
        left.apply(rate_bps=RATE)
        gone.delete()
        result = make(other.dev, other.server).apply(rate_bps=RATE)
        assert f"{gone.server}/{gone.dev}" in result["stale"], result
        assert not os.path.exists(left.places.pin_dir)


def test_remove_after_the_device_is_deleted_cleans_and_reports(sandbox, make):
    dp = make()
    dp.apply(rate_bps=RATE)
    sandbox.run(sandbox.server, "ip", "link", "del", sandbox.dev)
    result = dp.remove()
    assert result["removed"] is False and result["stale"], result
    assert not os.path.exists(dp.places.pin_dir)


APPLIER = """
import sys
from tc.datapath import Datapath
Datapath(sys.argv[1], sys.argv[2], run_dir=sys.argv[3]).apply(rate_bps=int(sys.argv[4]))
"""


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries `marker`: the applier and every child it started."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_kill_9_at_random_points_of_apply_leaves_a_recoverable_device(sandbox, tmp_path, make):
    """A process applying from scratch is killed at random moments, spread over the whole apply
    (one random point in each slice, compile child included). Nothing it started survives it,
    and each time the next apply, an idempotent re-apply and the next remove all succeed."""
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", APPLIER, sandbox.dev, sandbox.server, run_dir, str(RATE)]
    t0 = time.monotonic()
    subprocess.run(argv, env=env, check=True, timeout=120)
    span = time.monotonic() - t0
    dp = make()
    assert dp.remove()["removed"]
    slices = 14
    rng = random.Random()
    for i in range(slices):
        delay = span * (i + rng.random()) / slices
        marker = f"TN_KILLTEST={uuid.uuid4().hex}"
        key, value = marker.split("=")
        proc = subprocess.Popen(argv, env={**env, key: value}, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while _marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _marked_pids(marker) == [], f"kill at {delay:.3f} s: the applier's children outlived it"
        where = f"kill at {delay:.3f} s of {span:.3f} s"
        applied = dp.apply(rate_bps=RATE)
        assert applied["prog_id"], where
        assert dp.apply(rate_bps=RATE)["changes"] == 0, where
        assert tc(sandbox, "filter", "show").count("direct-action") == 1, where
        assert dp.remove()["removed"], where
        assert "noqueue" in tc(sandbox, "qdisc", "show"), where
        assert not os.path.exists(dp.places.pin_dir), where


def test_plan_says_what_apply_would_change_and_changes_nothing(sandbox, make):
    dp = make()
    assert dp.plan(rate_bps=RATE) == [
        "replace the root qdisc noqueue with htb 1:",
        "create 6 classes and 5 leaf queues",  # 1:1, the tiers and relax's limit class 1:41
        "compile and attach the classifier",
    ]
    assert "noqueue" in tc(sandbox, "qdisc", "show")
    dp.apply(rate_bps=RATE)
    assert dp.plan(rate_bps=RATE) == []
    dp.set_rate("relax", 5_000_000, 20_000_000)
    tc_do(sandbox, "class", "add", "dev", sandbox.dev, "parent", "1:1", "classid", "1:50", "htb", "rate", "1mbit")
    before = sorted(tc(sandbox, "class", "show").splitlines())
    assert dp.plan(rate_bps=RATE) == [
        "delete class 1:50 (not in the tree)",
        "set class 1:40 (relax) to rate 2mbit ceil 100mbit",
    ]
    assert sorted(tc(sandbox, "class", "show").splitlines()) == before


def test_concurrent_applies_on_one_device_take_turns(sandbox, tmp_path):
    """Two processes applying at once: the device's lock makes the second wait for the first;
    both succeed and the device holds one tree and one classifier."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", APPLIER, sandbox.dev, sandbox.server, str(tmp_path / "run"), str(RATE)]
    procs = [subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errors
        assert tc(sandbox, "filter", "show").count("direct-action") == 1
        assert tc(sandbox, "qdisc", "show").count("qdisc htb 1: root") == 1
    finally:
        from tc.datapath import Datapath

        Datapath(sandbox.dev, sandbox.server, run_dir=str(tmp_path / "run")).remove()
