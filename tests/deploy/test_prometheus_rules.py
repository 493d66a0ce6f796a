"""The shipped Prometheus configuration (deploy/prometheus/): `promtool check config` on the
scrape configuration and its targets, `promtool check rules`, the rules' unit tests with
`promtool test rules`, and proof that those tests can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.helpers import defined_metric_patterns, undefined
from tests.helpers import PROMTOOL_SKIP, ROOT

needs_promtool = pytest.mark.skipif(PROMTOOL_SKIP is not None, reason=PROMTOOL_SKIP or "")

RULES_DIR = ROOT / "deploy/prometheus"
RULES = RULES_DIR / "turbonode-rules.yml"
RULE_TESTS = RULES_DIR / "turbonode-rules.test.yml"


def promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@needs_promtool
def test_rules_pass_promtool_check():
    res = promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout and "WARNING" not in res.stdout + res.stderr


@needs_promtool
def test_rules_unit_tests_pass():
    res = promtool("test", "rules", str(RULE_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
@pytest.mark.parametrize(
    "old,new",
    [
        ("turbonode_degradation_level >= 3", "turbonode_degradation_level >= 2"),  # n2 (degraded) would alert
        ("for: 10m\n        labels: {severity: page}", "for: 1m\n        labels: {severity: page}"),  # fires too early
        ('{outcome="ok"}', ""),  # refusals counted in the p99
        ('\n              and on (instance) turbonode_worker_capacity_requests_per_second{tier="turbo"})', ")"),
        ("max(sum by (node) (", "max(("),  # the largest worker, not the largest node, taken out
    ],
)
def test_rules_unit_tests_can_fail(tmp_path, old, new):
    text = RULES.read_text()
    assert old in text
    (tmp_path / RULES.name).write_text(text.replace(old, new, 1))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    res = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert res.returncode != 0 and "FAILED" in res.stdout + res.stderr, res.stdout


def test_every_alert_is_unit_tested_and_documented():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert alerts and alerts == tested
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_rules_query_only_defined_metrics():
    exprs = " ".join(r["expr"] for r in _rules())
    recorded = {r["record"] for r in _rules() if "record" in r}
    names = set(re.findall(r"\bturbonode_\w+", exprs))
    names |= {f"re:{m}" for m in re.findall(r'__name__=~"([^"]+)"', exprs)}
    assert undefined(names, defined_metric_patterns()) == []
    # recording rules are used by name: a typo would silently alert on nothing
    used = set(re.findall(r"\bturbonode:[\w:]+", exprs))
    assert used <= recorded, used - recorded


@needs_promtool
def test_scrape_config_passes_promtool(tmp_path):
    config = yaml.safe_load((RULES_DIR / "prometheus.yml").read_text())
    targets = yaml.safe_load((RULES_DIR / "turbonode-targets.yml").read_text())
    shutil.copy(RULES, tmp_path / RULES.name)  # rule_files: relative to the configuration
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "turbonode-nodes.yml").write_text(yaml.safe_dump(targets))
    config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(tmp_path / "targets" / "turbonode-*.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    res = promtool("check", "config", str(tmp_path / "prometheus.yml"), cwd=tmp_path)
    assert res.returncode == 0 and "WARNING" not in res.stdout + res.stderr, res.stdout + res.stderr
    assert "1 rule files found" in res.stdout
    ports = {t.rsplit(":", 1)[1] for group in targets for t in group["targets"]}
    assert ports == {"9465", "8460", "8461"}  # each node's agent and its workers (one per GPU)
    job = config["scrape_configs"][0]
    assert job["job_name"] == "turbonode" and job["honor_labels"] is True  # TurbonodeTargetDown's job
