"""The QoS datapath on a real kernel: eBPF classifier under HTB in a sandbox namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import BCC_SKIP, ROOT, needs_bcc
from tests.tc.helpers import Wire, frames

pytestmark = [needs_bcc, pytest.mark.root]

RATE = 100_000_000
UNPARSED = "unparsed"

# case -> (tier, counted as unparsed)
EXPECT = {
    "ef": ("turbo", False),
    "ef_ecn": ("turbo", False),
    "af41": ("fast", False),
    "cs1": ("relax", False),
    "le": ("relax", False),
    "unmarked": ("other", False),
    "ipv6_ef": ("turbo", False),
    "ipv6_af41": ("fast", False),
    "ipv6_cs1": ("relax", False),
    "vlan_ef": ("turbo", False),
    "8021ad_ef": ("turbo", False),
    "truncated_ipv4": ("other", True),
    "truncated_ipv6": ("other", True),
    "bad_version": ("other", True),
    "non_ip": ("other", True),
    "runt": ("other", True),
}


def tc_text(sb, *args) -> str:
    return subprocess.run(["tc", "-n", sb.server, *args], capture_output=True, text=True, check=True).stdout


def cli(*args, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", "from turboctl import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=check,
    )


def snapshot(dp) -> dict:
    """{tier: (bpf packets, htb packets, drops)} plus unparsed packets."""
    view = dp.show()["tiers"]
    out = {t: (r["packets"], r["htb_sent_packets"], r["drops"]) for t, r in view.items() if t != UNPARSED}
    out[UNPARSED] = view[UNPARSED]["packets"]
    return out


@pytest.fixture
def datapath(sandbox):
    from tc.datapath import Datapath

    dp = Datapath(sandbox.dev, sandbox.server)
    try:
        dp.apply(rate_bps=RATE)
        yield dp
    finally:
        dp.remove()
        dp.close()


@pytest.fixture(scope="module")
def shared():
    """One sandbox and one applied datapath for the per-frame classification cases."""
    if BCC_SKIP:
        pytest.skip(BCC_SKIP)
    from sandbox.netns import Sandbox
    from tc.datapath import Datapath

    with Sandbox() as sb:
        dp = Datapath(sb.dev, sb.server)
        try:
            dp.apply(rate_bps=RATE)
            wire = Wire(sb)
            yield sb, dp, wire
            wire.close()
        finally:
            dp.remove()
            dp.close()


@pytest.mark.parametrize("case", list(EXPECT))
def test_frame_lands_in_its_class_and_arrives(shared, case):
    sb, dp, wire = shared
    tier, unparsed = EXPECT[case]
    frame = frames(sb)[case]
    n = 7
    before = snapshot(dp)
    wire.send(frame, n)
    arrived = wire.received(frame, n)
    after = snapshot(dp)
    assert arrived == n, f"{case}: only {arrived}/{n} frames reached the peer (dropped?)"
    bpf = {t: after[t][0] - before[t][0] for t in EXPECT_TIERS}
    htb = {t: after[t][1] - before[t][1] for t in EXPECT_TIERS}
    if tier == "other":
        # Background frames (IPv6 ND, ...) also land in 'other': at least ours.
        assert bpf["other"] >= n and htb["other"] >= n
    else:
        assert bpf[tier] == n and htb[tier] == n, (case, bpf, htb)
    for t in EXPECT_TIERS:
        if t not in (tier, "other"):
            assert bpf[t] == 0 and htb[t] == 0, (case, t, bpf, htb)
        assert after[t][2] == 0, f"class {t} dropped frames"
    if unparsed:
        assert after[UNPARSED] - before[UNPARSED] >= n
    elif tier != "other":
        assert after[UNPARSED] == before[UNPARSED]


EXPECT_TIERS = ("turbo", "fast", "other", "relax")


def test_apply_is_idempotent(sandbox, datapath):
    tree = (
        tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev),
        tc_text(sandbox, "class", "show", "dev", sandbox.dev),
    )
    filters = tc_text(sandbox, "filter", "show", "dev", sandbox.dev)
    again = datapath.apply(rate_bps=RATE)
    assert again["changes"] == 0 and not again["compiled"]
    assert (
        tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev),
        tc_text(sandbox, "class", "show", "dev", sandbox.dev),
    ) == tree
    assert tc_text(sandbox, "filter", "show", "dev", sandbox.dev) == filters
    assert filters.count("direct-action") == 1
    # A different rate changes the classes in place, still one filter.
    changed = datapath.apply(rate_bps=RATE // 2)
    assert changed["changes"] == 6 and not changed["compiled"]  # 1:1, four tiers, relax's limit class
    assert "rate 50Mbit" in tc_text(sandbox, "class", "show", "dev", sandbox.dev)
    assert tc_text(sandbox, "filter", "show", "dev", sandbox.dev).count("direct-action") == 1


def test_remove_restores_previous_root_and_unpins(sandbox):
    from tc.datapath import Datapath

    before = tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev)
    assert "noqueue" in before
    dp = Datapath(sandbox.dev, sandbox.server)
    dp.apply(rate_bps=RATE)
    assert os.path.isdir(dp.places.pin_dir)
    assert not os.path.exists(dp.places.lock_file)  # held only while a change runs
    result = dp.remove()
    assert result == {"removed": True, "root": "noqueue", "restored": True, "stale": []}
    assert tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev) == before
    assert not os.path.exists(dp.places.pin_dir) and not os.path.exists(dp.places.lock_file)
    assert not os.path.exists(os.path.dirname(dp.places.pin_dir))  # no empty per-netns dir left
    assert not os.path.exists(os.path.dirname(dp.places.lock_file))
    assert dp.remove()["removed"] is False  # a second remove is a no-op


def test_refuses_to_replace_a_root_qdisc_it_did_not_create(sandbox):
    from tc.datapath import Datapath
    from turbonode.errors import DatapathError

    subprocess.run(
        [
            "tc",
            "-n",
            sandbox.server,
            "qdisc",
            "add",
            "dev",
            sandbox.dev,
            "root",
            "handle",
            "5:",
            "tbf",
            "rate",
            "10mbit",
            "burst",
            "10kb",
            "latency",
            "50ms",
        ],
        check=True,
    )
    dp = Datapath(sandbox.dev, sandbox.server)
    with pytest.raises(DatapathError, match="tbf 5:0 that turbonode did not create"):
        dp.apply(rate_bps=RATE)
    assert "qdisc tbf 5:" in tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev)
    assert dp.remove()["removed"] is False
    assert "qdisc tbf 5:" in tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev)


def test_datapath_outlives_the_process_that_applied_it(sandbox):
    from tc.datapath import Datapath

    cli("qos", "apply", "--dev", sandbox.dev, "--netns", sandbox.server, "--rate", "100mbit")
    dp = Datapath(sandbox.dev, sandbox.server)
    try:
        wire = Wire(sandbox)
        frame = frames(sandbox)["ef"]
        before = snapshot(dp)
        wire.send(frame, 10)
        assert wire.received(frame, 10) == 10
        wire.close()
        after = snapshot(dp)
        assert after["turbo"][0] - before["turbo"][0] == 10
        assert after["turbo"][1] - before["turbo"][1] == 10
    finally:
        dp.remove()


def test_reload_keeps_pinned_counters_and_traffic_flows(sandbox, datapath):
    wire = Wire(sandbox)
    frame = frames(sandbox)["ef"]
    wire.send(frame, 5)
    assert wire.received(frame, 5) == 5
    wire.close()  # its receive buffer would overflow with the pings below
    first = datapath.show()
    # Swap the program (as an upgraded agent would) while pings run: no gap, counters kept.
    ping = sandbox.popen(
        sandbox.server,
        "ping",
        "-q",
        "-i",
        "0.005",
        "-c",
        "300",
        "-Q",
        "0xb8",
        sandbox.client_ip,
        stdout=subprocess.PIPE,
        text=True,
    )
    swapped = datapath.apply(rate_bps=RATE, reload=True)
    out, _ = ping.communicate(timeout=30)
    assert swapped["compiled"] and swapped["prog_id"] != first["prog_id"]
    assert " 0% packet loss" in out, out
    wire = Wire(sandbox)
    wire.send(frame, 5)
    assert wire.received(frame, 5) == 5
    wire.close()
    turbo = datapath.show()["tiers"]["turbo"]["packets"]
    assert turbo >= first["tiers"]["turbo"]["packets"] + 5 + 300  # old counts were not reset
    assert tc_text(sandbox, "filter", "show", "dev", sandbox.dev).count("direct-action") == 1


def test_live_map_change_resteers(sandbox, datapath):
    wire = Wire(sandbox)
    frame = frames(sandbox)["unmarked"]
    datapath.set_map({0: "relax"})
    before = snapshot(datapath)
    wire.send(frame, 6)
    assert wire.received(frame, 6) == 6
    after = snapshot(datapath)
    # >=: the kernel's own unmarked frames (IPv6 ND, MLD) are re-steered too.
    assert after["relax"][0] - before["relax"][0] >= 6 and after["relax"][1] - before["relax"][1] >= 6
    datapath.set_map({0: "other"})
    before = after
    wire.send(frame, 6)
    assert wire.received(frame, 6) == 6
    after = snapshot(datapath)
    assert after["relax"][0] == before["relax"][0]
    wire.close()
    # Apply is declarative: the configured map wins over a live change.
    datapath.set_map({10: "fast"})
    assert 10 in datapath.show()["tiers"]["fast"]["dscp"]
    datapath.apply(rate_bps=RATE)
    assert 10 in datapath.show()["tiers"]["other"]["dscp"]


def test_live_set_rate_changes_class_without_reload(sandbox, datapath):
    prog = datapath.show()["prog_id"]
    filters = tc_text(sandbox, "filter", "show", "dev", sandbox.dev)
    r = datapath.set_rate("relax", 5_000_000, 20_000_000)
    assert r == {"tier": "relax", "rate_bps": 5_000_000, "ceil_bps": 20_000_000}
    assert "class htb 1:40 parent 1:1 leaf 40: prio 3 rate 5Mbit ceil 20Mbit" in tc_text(
        sandbox, "class", "show", "dev", sandbox.dev
    )
    assert datapath.show()["prog_id"] == prog
    assert tc_text(sandbox, "filter", "show", "dev", sandbox.dev) == filters


def test_shaping_is_real(sandbox, datapath):
    """The root really shapes: a 1 s TCP flow through the tree stays near the link rate."""
    datapath.apply(rate_bps=20_000_000)
    bps = None
    for _ in range(3):  # iperf3 occasionally reports no result (server not yet listening)
        server = sandbox.popen(sandbox.client, "iperf3", "-s", "-1", stdout=subprocess.DEVNULL)
        time.sleep(0.3)
        try:
            out = subprocess.run(
                sandbox.cmd(sandbox.server, "iperf3", "-c", sandbox.client_ip, "-t", "1", "-J"),
                capture_output=True,
                text=True,
                timeout=30,
            )
        finally:
            server.kill()
            server.wait()
        bps = json.loads(out.stdout or "{}").get("end", {}).get("sum_received", {}).get("bits_per_second")
        if bps:
            break
    assert bps, out.stdout[-800:] + out.stderr
    assert 12e6 < bps < 23e6, bps
    assert datapath.show()["tiers"]["other"]["htb_sent_bytes"] > 1_000_000


def test_remove_restores_a_kernel_default_root_with_a_queue(sandbox):
    """An IFB device gets the kernel's default qdisc (it has a tx queue, unlike veth)."""
    from tc.datapath import Datapath

    subprocess.run(["ip", "-n", sandbox.server, "link", "add", "tnifb0", "type", "ifb"], check=True)
    subprocess.run(["ip", "-n", sandbox.server, "link", "set", "tnifb0", "up"], check=True)
    before = tc_text(sandbox, "qdisc", "show", "dev", "tnifb0")
    kind = before.split()[1]
    assert kind != "noqueue" and " 0: root" in before
    dp = Datapath("tnifb0", sandbox.server)
    dp.apply(rate_bps=RATE)
    assert "qdisc htb 1: root" in tc_text(sandbox, "qdisc", "show", "dev", "tnifb0")
    assert dp.remove() == {"removed": True, "root": kind, "restored": True, "stale": []}
    assert tc_text(sandbox, "qdisc", "show", "dev", "tnifb0") == before


def test_a_wiped_run_dir_does_not_orphan_the_tree(sandbox, tmp_path):
    """/run wiped (the tree and pins survive): the kernel's own mark still says the tree is
    ours, and nothing is recompiled."""
    from tc.datapath import Datapath

    dp = Datapath(sandbox.dev, sandbox.server, run_dir=str(tmp_path / "run"))
    try:
        dp.apply(rate_bps=RATE)
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        again = dp.apply(rate_bps=RATE)
        assert again["changes"] == 0 and not again["compiled"]
        assert tc_text(sandbox, "filter", "show", "dev", sandbox.dev).count("direct-action") == 1
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        assert dp.remove()["removed"] is True
        assert "noqueue" in tc_text(sandbox, "qdisc", "show", "dev", sandbox.dev)
    finally:
        dp.remove()


def test_a_tree_of_an_earlier_version_is_still_ours(sandbox, monkeypatch):
    """Roots made before the r2q mark carry only the classifier filter's name: still ours."""
    import tc.netlink
    from tc.datapath import Datapath
    from tc.tree import OWNER_R2Q

    dp = Datapath(sandbox.dev, sandbox.server)
    try:
        with monkeypatch.context() as m:
            m.setattr(tc.netlink, "OWNER_R2Q", 10)  # what the earlier version's root had: the default
            dp.apply(rate_bps=RATE)
        qdisc = tc_text(sandbox, "-d", "qdisc", "show", "dev", sandbox.dev, "root")
        assert "r2q 10 " in qdisc and f"r2q {OWNER_R2Q} " not in qdisc, qdisc
        again = dp.apply(rate_bps=RATE)
        assert again["changes"] == 0 and not again["compiled"]
        assert dp.remove()["removed"] is True
        dp.apply(rate_bps=RATE)
        assert f"r2q {OWNER_R2Q} " in tc_text(sandbox, "-d", "qdisc", "show", "dev", sandbox.dev, "root")
    finally:
        dp.remove()


def test_show_dumps_each_table_once_and_refuses_a_tree_not_ours(sandbox, datapath, monkeypatch):
    """The agent's HTB watcher reads show() every few seconds: the ownership check uses the same
    qdisc and filter dumps as the view (each netlink dump costs milliseconds of the agent's CPU)."""
    from tc.netlink import Link
    from turbonode.errors import DatapathError

    dumps: list[str] = []
    for name in ("qdiscs", "filters", "classes"):
        real = getattr(Link, name)
        monkeypatch.setattr(
            Link, name, lambda self, *a, _real=real, _name=name, **k: dumps.append(_name) or _real(self, *a, **k)
        )
    view = datapath.show()
    assert sorted(dumps) == ["classes", "filters", "qdiscs"]
    assert view["prog_id"] and view["leaf_kind"] and view["tiers"]["turbo"]["class"] == "1:10"
    tc_text(sandbox, "qdisc", "del", "dev", sandbox.dev, "root")
    with pytest.raises(DatapathError, match="no turbonode QoS"):
        datapath.show()
