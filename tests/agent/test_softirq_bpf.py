"""The real eBPF softirq probe sees NET_RX work while traffic crosses a sandbox veth."""

import time

import pytest

from agent.watchers.base import MIN_RATE_WINDOW_S
from agent.watchers.softirq import NET_RX, NR_SLOTS, SoftirqWatcher, missing_tracepoints
from tests.agent.helpers import scrape
from tests.helpers import needs_bcc

pytestmark = [needs_bcc, pytest.mark.root]


@pytest.fixture
def watcher():
    if missing_tracepoints():
        pytest.skip(f"tracepoints unavailable: {missing_tracepoints()} (mount tracefs)")
    w = SoftirqWatcher()
    assert w.probe is not None, w.bpf_error
    yield w
    w.close()


def test_probe_sees_net_rx_time_and_latency(watcher, sandbox):
    t0 = time.monotonic()
    watcher.sample(t0)
    time0 = sum(watcher.probe.time_ns(NET_RX))
    runs0 = sum(watcher.probe.runs(NET_RX))
    # Bounded flood: 3000 echo requests, at most 10 s, only between the sandbox namespaces.
    sandbox.run(sandbox.client, "ping", "-f", "-q", "-c", "3000", "-w", "10", sandbox.server_ip, timeout=20)
    time.sleep(max(0.0, t0 + MIN_RATE_WINDOW_S - time.monotonic()))  # a flood on veth can outrun the rate window
    sig = watcher.sample(time.monotonic())
    assert watcher.ok and watcher.mode == "bpf"
    runs = sum(watcher.probe.runs(NET_RX)) - runs0
    assert runs >= 3000, runs  # each echo and reply is received through NET_RX
    assert sum(watcher.probe.time_ns(NET_RX)) > time0
    assert sig["netrx_per_s"] > 0 and 0 < sig["netrx_cpu_share"] <= 1
    assert sig["netrx_latency_p99_s"] is not None and 0 < sig["netrx_latency_p99_s"] < 1.0

    text = scrape(watcher)
    assert "turbonode_softirq_collector_success 1.0" in text
    assert 'turbonode_softirq_seconds_total{cpu="0",vector="NET_RX"}' in text
    assert 'turbonode_softirq_latency_seconds_bucket{le="+Inf",vector="NET_RX"}' in text


def test_missing_tracepoints_fall_back_to_procfs(tmp_path):
    w = SoftirqWatcher(sysfs=str(tmp_path))  # an empty sysfs root: no tracefs at all
    assert w.probe is None and "tracefs not mounted" in w.bpf_error
    w.sample(0)
    assert w.ok and w.mode == "procfs"


def test_the_latency_histogram_is_read_in_one_batch(watcher, sandbox, monkeypatch):
    """Every sample reads NET_RX's 32 histogram slots: one BPF_MAP_LOOKUP_BATCH, not 32 lookups,
    with the same counts as the slot-by-slot read (between two of them: the counters only grow)."""
    probe = watcher.probe
    sandbox.run(sandbox.client, "ping", "-f", "-q", "-c", "500", "-w", "5", sandbox.server_ip, timeout=10)
    slots = range(NET_RX * NR_SLOTS, (NET_RX + 1) * NR_SLOTS)
    before = [sum(probe._per_cpu(probe._lat, k)) for k in slots]
    per_slot = probe._per_cpu
    monkeypatch.setattr(probe, "_per_cpu", lambda *a: pytest.fail("a lookup per slot"))
    batch = probe.latency(NET_RX)
    monkeypatch.setattr(probe, "_per_cpu", per_slot)
    after = [sum(probe._per_cpu(probe._lat, k)) for k in slots]
    assert probe.batch_error is None and sum(batch) > 0
    assert all(b <= x <= a for b, x, a in zip(before, batch, after))
    assert watcher.summary()["bpf_batch_error"] is None
