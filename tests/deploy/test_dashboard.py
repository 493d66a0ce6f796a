"""The shipped Grafana dashboard against a real Prometheus scraping a real node.

A worker (tiny model) and an agent (eBPF classifier on a sandbox interface, thresholds low
enough that it escalates to critical and throttles the worker) run as subprocesses, as
systemd runs them; Prometheus (Debian's binary) scrapes both with the shipped scrape
configuration and rules. After tiered traffic - images of every tier, a full relax queue,
turbo refused while the node is critical - every panel's every expression is queried with
the Node selector set to this node: one that returns nothing fails the test. Without a GPU
the GPU row cannot have data: its panels are excepted, and the test says so.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import yaml

from sandbox.loadgen import request_image
from tests.deploy.helpers import PROMETHEUS_SKIP, Prometheus
from tests.helpers import BCC_SKIP, ROOT, daemon_env, free_port, start, stop, turboctl_argv

pytestmark = [
    pytest.mark.skipif(PROMETHEUS_SKIP is not None, reason=PROMETHEUS_SKIP or ""),
    pytest.mark.skipif(BCC_SKIP is not None, reason=BCC_SKIP or ""),
]

DASHBOARD = ROOT / "deploy/grafana/turbonode.json"
SCRAPE_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
RULES = ROOT / "deploy/prometheus/turbonode-rules.yml"
GPU_METRIC = re.compile(r"\bturbonode_gpu_")
WINDOW = "2m"  # $__rate_interval: the whole run, so each tier's few requests stay in the window


def panel_queries(dashboard: dict, node: str, worker: str = "default") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, with the dashboard's variables filled in as
    Grafana would for one selected node and worker (names without regex metacharacters)."""
    assert re.fullmatch(r"[\w-]+", node) and re.fullmatch(r"[\w-]+", worker), (node, worker)
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", WINDOW).replace("$node", node).replace("$worker", worker)
            assert "$" not in expr, f"unresolved variable in {panel['title']}: {expr}"
            out.append((panel["title"], expr))
    return out


def has_data(result: list[dict]) -> bool:
    """Some sample that is a number: histogram_quantile over nothing answers NaN, not an empty vector."""
    values = [r["value"][1] for r in result] if result and "value" in result[0] else []
    return any(not math.isnan(float(v)) for v in values)


def _worker_config(directory: Path, node: str, port: int) -> Path:
    cfg = directory / "worker.toml"
    cfg.write_text(f"""
[node]
name = "{node}"
[worker]
listen = "127.0.0.1:{port}"
control_socket = "{directory}/worker.sock"
model = "tiny"
device = "cpu"
size = 64
refuse_unready = true
queue_limit = {{relax = 1}}
""")
    return cfg


def _agent_config(directory: Path, node: str, sandbox, port: int) -> Path:
    cfg = directory / "agent.toml"
    # Low thresholds: any CPU use escalates one level per 0.3 s, up to critical, and stays.
    cfg.write_text(f"""
[node]
name = "{node}"
[qos]
dev = "{sandbox.dev}"
netns = "{sandbox.server}"
rate = "100mbit"
keep_on_stop = false
[agent]
socket = "{directory}/agent.sock"
worker_socket = "{directory}/worker.sock"
metrics = "127.0.0.1:{port}"
sample_period = 0.1
[policy]
enter_s = 0
min_change_interval = 0.3
rules = {{ cpu_load = {{ enter = 0.001, exit = 0.0005, max_level = "critical" }} }}
""")
    return cfg


def _prometheus_config(targets_file: Path) -> dict:
    """The shipped scrape configuration, faster and pointed at this test's node."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(targets_file)]
    return config


def _traffic(url: str) -> None:
    """Images of every tier, with async relax jobs filling relax's queue (limit 1): 429s."""
    threads = [
        threading.Thread(target=request_image, args=(url, tier), kwargs={"size": 64, "steps": 2})
        for tier in ("turbo", "fast", "other", "relax")
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    body = json.dumps({"prompt": "slow relax", "tier": "relax", "size": "64x64", "steps": 60, "async": True})
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    codes = []
    for _ in range(4):
        try:
            with urlopen(
                Request(url + "/v1/images/generations", body.encode(), {"Content-Type": "application/json"}), timeout=30
            ) as resp:
                codes.append(resp.status)
        except HTTPError as exc:
            codes.append(exc.code)
    assert 429 in codes, codes


@pytest.mark.slow
def test_every_dashboard_panel_has_data(sandbox, tmp_path):
    node = f"tn-dash-{uuid.uuid4().hex[:6]}"
    worker_port, agent_port = free_port(), free_port()
    targets = tmp_path / "targets.yml"
    targets.write_text(
        yaml.safe_dump(
            [
                {"targets": [f"127.0.0.1:{agent_port}"], "labels": {"component": "agent"}},
                {"targets": [f"127.0.0.1:{worker_port}"], "labels": {"component": "worker"}},
            ]
        )
    )
    worker = agent = None
    # Prometheus first: every event below happens while it scrapes, as on a node in production.
    with Prometheus(_prometheus_config(targets)) as prom:
        try:
            worker, wout = start(
                turboctl_argv("worker", "run", "--config", str(_worker_config(tmp_path, node, worker_port))),
                daemon_env(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache")),
            )
            assert wout.wait_for(r"serving http://", 180), wout.text
            url = f"http://127.0.0.1:{worker_port}"
            assert prom.wait_for(f'up{{instance="127.0.0.1:{worker_port}"}} == 1', 30)
            _traffic(url)

            agent, aout = start(
                turboctl_argv(
                    "-v", "agent", "run", "--config", str(_agent_config(tmp_path, node, sandbox, agent_port))
                ),
                daemon_env(),
            )
            # the node's egress, classified: EF pings and unmarked ones through the sandbox link
            assert aout.wait_for(r"metrics on ", 90), aout.text
            for tos in ("0xb8", "0x00"):
                sandbox.run(sandbox.server, "ping", "-c", "3", "-i", "0.2", "-Q", tos, sandbox.client_ip, check=False)
            assert prom.wait_for("turbonode_degradation_level == 3", 60), aout.text
            # critical: the agent's throttle makes the worker not ready for turbo; new turbo work gets 503
            deadline = time.monotonic() + 20
            while request_image(url, "turbo", size=64, steps=2).status != 503:
                assert time.monotonic() < deadline, "turbo never refused at level critical"
                time.sleep(0.2)
            assert prom.wait_for('turbonode_worker_requests_total{tier="turbo", code="503"}', 20)
            time.sleep(3)  # a few more scrapes after the last event

            # the Node selector: one value, shared by both daemons; Prometheus' own `up` has it from relabeling
            nodes = prom.api("label/node/values", **{"match[]": "turbonode_build_info"})
            assert nodes == [node], nodes
            components = {r["metric"]["component"] for r in prom.query(f'turbonode_build_info{{node="{node}"}}')}
            assert components == {"agent", "worker"}
            assert {r["metric"]["node"] for r in prom.query('up{job="turbonode"}')} == {"127.0.0.1"}
            # the Worker selector: the node's workers by name (one here: a file naming none has `default`)
            worker_var = next(
                v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "worker"
            )
            assert "turbonode_worker_ready" in worker_var["definition"] and worker_var["allValue"] == ".*"
            workers = prom.api("label/worker/values", **{"match[]": f'turbonode_worker_ready{{node="{node}"}}'})
            assert workers == ["default"], workers

            # the check can fail: a misspelt metric and a quantile over nothing have no data
            assert not has_data(prom.query(f'turbonode_worker_request_duration_second{{node="{node}"}}'))
            assert not has_data(prom.query("histogram_quantile(0.99, rate(turbonode_nothing_bucket[1m]))"))
            empty, gpu_skipped = [], []
            for title, expr in panel_queries(json.loads(DASHBOARD.read_text()), node):
                if has_data(prom.query(expr)):
                    continue
                (gpu_skipped if GPU_METRIC.search(expr) else empty).append(f"{title}: {expr}")
            assert not empty, "panels without data:\n" + "\n".join(empty)
            if gpu_skipped:
                warnings.warn(
                    f"no GPU here: {len(gpu_skipped)} GPU panel queries have no data, as expected "
                    f"without NVML ({'; '.join(t.split(':')[0] for t in gpu_skipped)})",
                    stacklevel=1,
                )

            # the shipped rules load and evaluate against these series
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            assert rules and all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
            assert prom.query(f'turbonode:request_duration_seconds:p99_5m{{node="{node}", tier="turbo"}}')
        finally:
            for proc in (agent, worker):
                if proc is not None:
                    stop(proc, 60)
