"""Metrics: the agent's and the worker's real scrape output passes `promtool check metrics`,
and the Grafana dashboard only queries metrics the code defines."""

from __future__ import annotations

import pytest
from daemon_harness import PROMTOOL_SKIP, promtool_check

needs_promtool = pytest.mark.skipif(PROMTOOL_SKIP is not None, reason=PROMTOOL_SKIP or "")


@needs_promtool
def test_promtool_check_can_fail():
    good = "# HELP turbonode_x_total things\n# TYPE turbonode_x_total counter\nturbonode_x_total 3\n"
    assert promtool_check(good).returncode == 0
    bad = good.replace("_total", "")  # a counter without _total
    res = promtool_check(bad)
    assert res.returncode != 0 and "_total" in res.stdout + res.stderr
