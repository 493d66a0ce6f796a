"""Metrics: the agent's and the worker's real scrape output passes `promtool check metrics`,
and the Grafana dashboard only queries metrics the code defines."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.helpers import defined_metric_patterns, undefined
from tests.helpers import PROMTOOL_SKIP, ROOT, promtool_check

needs_promtool = pytest.mark.skipif(PROMTOOL_SKIP is not None, reason=PROMTOOL_SKIP or "")


@needs_promtool
def test_promtool_check_can_fail():
    good = "# HELP turbonode_x_total things\n# TYPE turbonode_x_total counter\nturbonode_x_total 3\n"
    assert promtool_check(good).returncode == 0
    bad = good.replace("_total", "")  # a counter without _total
    res = promtool_check(bad)
    assert res.returncode != 0 and "_total" in res.stdout + res.stderr


# ---- the Grafana dashboard queries only metrics the code defines -----------------------------


DASHBOARD = ROOT / "deploy/grafana/turbonode.json"


def dashboard_metric_names(dashboard: dict) -> set[str]:
    """Metric names in every panel's PromQL: bare names and __name__ regex matchers."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            names |= {f"re:{m}" for m in re.findall(r'__name__=~"([^"]+)"', expr)}
            expr = re.sub(r'__name__=~"[^"]+"', "", expr)
            names |= set(re.findall(r"\bturbonode_\w+", expr))
    return names


def test_dashboard_queries_only_defined_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    names = dashboard_metric_names(dashboard)
    assert len(names) >= 15
    patterns = defined_metric_patterns()
    assert undefined(names, patterns) == []
    # the check can fail: a misspelt name and a regex that matches nothing are reported
    assert undefined({"turbonode_tier_byte_total", "re:turbonode_nothing_.+"}, patterns) == [
        "re:turbonode_nothing_.+",
        "turbonode_tier_byte_total",
    ]


def test_dashboard_covers_the_issue():
    """Per-tier latency and traffic, degradation level and reasons, throttling, GC, GPU."""
    dashboard = json.loads(DASHBOARD.read_text())
    names = dashboard_metric_names(dashboard)
    for needed in (
        "turbonode_tier_bytes_total",
        "turbonode_worker_request_duration_seconds_bucket",
        "turbonode_worker_request_stage_seconds_bucket",
        "turbonode_worker_requests_total",
        "turbonode_degradation_level",
        "turbonode_throttle_actions_total",
        "turbonode_worker_gc_pause_seconds_bucket",
        "turbonode_gpu_utilization_ratio",
    ):
        assert needed in names
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["templating"]["list"]
    for panel in dashboard["panels"]:
        assert panel["type"] == "row" or panel["datasource"]["uid"] == "${datasource}", panel["title"]


# ---- the Kubernetes scrape configuration (deploy/prometheus/) ------------------------------


def _annotation_label(key: str) -> str:
    """Prometheus' meta label for a pod annotation (every non-alphanumeric becomes _)."""
    return "__meta_kubernetes_pod_annotation_" + re.sub(r"\W", "_", key)


def test_kubernetes_scrape_config_matches_the_manifests():
    """Debian's promtool is built without Kubernetes discovery, so this checks the structure:
    the relabelling reads exactly the annotations the pod templates carry, and the daemons'
    own `node` label is kept."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus-kubernetes.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod" and job["honor_labels"] is True
    read = {label for rule in job["relabel_configs"] for label in rule["source_labels"]}
    for rule in job["relabel_configs"]:
        re.compile(rule.get("regex", "(.*)"))
    for path in (ROOT / "deploy/kubernetes").glob("*-daemonset.yaml"):
        annotations = yaml.safe_load(path.read_text())["spec"]["template"]["metadata"]["annotations"]
        assert {_annotation_label(k) for k in annotations} <= read, path.name
