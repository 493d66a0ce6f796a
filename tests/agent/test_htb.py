"""HTB watcher and the relax-ceil action on a real datapath in a sandbox namespace."""

import pytest

from agent.actuator import Actuator
from agent.policy import Actions
from agent.watchers.htb import HtbWatcher
from tests.agent.helpers import scrape
from tests.helpers import needs_bcc
from turbonode.config import QosConfig

pytestmark = [needs_bcc, pytest.mark.root]


@pytest.fixture
def datapath(sandbox, tmp_path):
    from tc.datapath import Datapath

    dp = Datapath(sandbox.dev, sandbox.server, run_dir=str(tmp_path))
    dp.apply(QosConfig(rate="100mbit"))
    yield dp
    dp.remove()


def test_htb_watcher_counts_tiers_and_relax_ceil_moves(sandbox, datapath):
    w = HtbWatcher(datapath)
    w.sample(0.0)
    assert w.ok, w.error
    # EF (TOS 0xb8) echo requests from the node: classified turbo on its egress.
    sandbox.run(sandbox.server, "ping", "-Q", "0xb8", "-c", "20", "-i", "0.01", "-w", "5", sandbox.client_ip)
    w.sample(w.interval)
    assert w.detail["tiers"]["turbo"]["packets"] >= 20
    assert w.signals["turbo_drops_per_s"] == 0

    act = Actuator(datapath=datapath, relax_rate_bps=10_000_000, link_bps=100_000_000)
    act.apply(Actions(relax_ceil_pct=25), "degraded", "cpu_load", 0)
    assert act.datapath_error is None
    relax = datapath.show()["tiers"]["relax"]
    assert relax["ceil_bps"] == 25_000_000 and relax["limit"]["in_force"], relax
    w.sample(2 * w.interval)
    assert 'turbonode_tier_ceil_bytes_per_second{tier="relax"} 3.125e+06' in scrape(w)  # the ceiling in force
    act.apply(Actions(), "normal", "cpu_load", 1)
    relax = datapath.show()["tiers"]["relax"]
    assert relax["ceil_bps"] == 100_000_000 and not relax["limit"]["in_force"], relax

    text = scrape(w)
    assert "turbonode_htb_collector_success 1.0" in text
    assert 'turbonode_tier_packets_total{tier="turbo"}' in text
    assert 'turbonode_tier_ceil_bytes_per_second{tier="relax"}' in text
