"""`turboctl demo` end to end on a real sandbox (bounded: a few seconds of traffic)."""

import re
import subprocess

import pytest
from click.testing import CliRunner

from tests.helpers import needs_bcc
from turboctl import main


@needs_bcc
@pytest.mark.slow
def test_demo_shapes_mixed_traffic_and_cleans_up():
    res = CliRunner().invoke(main, ["demo", "--qos-only", "--seconds", "4"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "EF ping under that load: p50" in out and "turboctl qos show:" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for tier in ("turbo", "fast", "other", "relax"):
        assert rows[tier][1] == f"1:{ {'turbo': 10, 'fast': 20, 'other': 30, 'relax': 40}[tier] }"
        # bytes, not packets: the counters see GSO super-packets of up to 64 KiB
        assert int(rows[tier][4]) > 100_000, f"{tier} classified almost nothing: {rows[tier]}"
    # Every tier got traffic through: turbo its paced 20 %, each greedy lower tier at least its
    # guarantee (turbo first: 5/3/2 %; fast, the highest-priority borrower, takes what is left).
    shares = {
        line.split()[0]: float(line.split()[1])
        for line in out.splitlines()
        if line.startswith("  ") and "Mbit/s" in line
    }
    assert shares["turbo"] >= 15 and shares["fast"] >= 4 and shares["other"] >= 2.4 and shares["relax"] >= 1.6
    # Its own namespaces are gone (other tests may be creating theirs meanwhile).
    created = re.search(r"netns (\S+) \(\S+\) <-> netns (\S+);", out).groups()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(created) & set(listed)
