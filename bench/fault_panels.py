"""One CPU fault on a node watched by a real Prometheus: what the dashboard's panels say before,
during and after it (docs/service.md, "One fault, panel by panel").

    flock /tmp/turbonode-bench.lock python bench/fault_panels.py [--healthy 25] [--fault 25] [--after 20]

A worker (tiny model) and an agent with the default policy run as `turboctl` subprocesses;
Prometheus (Debian's binary) scrapes both with deploy/prometheus/prometheus.yml and evaluates
deploy/prometheus/turbonode-rules.yml at a 1 s interval. A closed-loop load (sandbox.loadgen:
one turbo, one fast and two relax clients) runs throughout; stress-ng on every CPU, inside a
network namespace this script creates, is the fault. At the end of each phase the script
prints what a set of the dashboard's queries answer (15 s windows) and, last, the alerts.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import flat, record, variant_of  # noqa: E402
from sandbox.loadgen import run_load  # noqa: E402
from sandbox.netns import Sandbox  # noqa: E402
from tests.deploy.helpers import Prometheus  # noqa: E402
from tests.helpers import daemon_env, free_port, start, stop, turboctl_argv  # noqa: E402

NODE = "fault-node"
WINDOW = "15s"  # stands for the dashboard's $__rate_interval
DASHBOARD = ROOT / "deploy/grafana/turbonode.json"
SKIP = ("GPU", "Versions", "Collector health")  # no GPU here; nothing a fault changes


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, query, legend) of the shipped dashboard, its Node selector set to this node."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if any(word in panel["title"] for word in SKIP):
            continue
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$node", NODE).replace("$__rate_interval", WINDOW)
            out.append((panel["title"], expr, target.get("legendFormat") or "{{tier}}"))
    return out


def snapshot(prom: Prometheus) -> dict[str, dict[str, float]]:
    """Panel -> {series as its legend names it: value}; NaN (no events in the window) left out."""
    out: dict[str, dict[str, float]] = {}
    for title, expr, legend in panel_queries():
        for row in prom.query(expr):
            value = float(row["value"][1])
            if value == value:  # NaN: a quantile over nothing
                labels = row["metric"]
                name = re.sub(r"\{\{(\w+)\}\}", lambda m, labels=labels: labels.get(m.group(1), ""), legend).strip()
                out.setdefault(title, {})[name or "-"] = round(value, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--healthy", type=float, default=25, help="seconds of load before the fault")
    ap.add_argument("--fault", type=int, default=25, help="seconds of stress-ng on every CPU")
    ap.add_argument("--after", type=float, default=20, help="seconds of load after the fault")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tn-fault-"))
    worker_port, agent_port = free_port(), free_port()
    config = work / "turbonode.toml"
    config.write_text(
        f'[node]\nname = "{NODE}"\n'
        f'[worker]\nlisten = "127.0.0.1:{worker_port}"\ncontrol_socket = "{work}/w.sock"\nmodel = "tiny"\n'
        'device = "cpu"\nsize = 64\nsteps = { turbo = 2, fast = 4, other = 6, relax = 8 }\n'
        f'[agent]\nsocket = "{work}/a.sock"\nworker_socket = "{work}/w.sock"\nmetrics = "127.0.0.1:{agent_port}"\n'
    )
    (work / "targets.yml").write_text(
        yaml.safe_dump([{"targets": [f"127.0.0.1:{agent_port}", f"127.0.0.1:{worker_port}"]}])
    )
    prom_config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    prom_config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    prom_config["rule_files"] = [str(ROOT / "deploy/prometheus/turbonode-rules.yml")]
    prom_config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(work / "targets.yml")]
    procs = []
    try:
        with Prometheus(prom_config) as prom, Sandbox(prefix="tnf") as sb:
            with open(config, "a") as f:  # the agent shapes the sandbox node's device
                f.write(f'[qos]\ndev = "{sb.dev}"\nnetns = "{sb.server}"\nrate = "100mbit"\nkeep_on_stop = false\n')
            worker, wout = start(turboctl_argv("worker", "run", "--config", str(config)), daemon_env())
            procs.append(worker)
            agent, aout = start(turboctl_argv("agent", "run", "--config", str(config)), daemon_env())
            procs.append(agent)
            if not wout.wait_for("serving", 180) or not prom.wait_for(
                f'turbonode_degradation_level{{node="{NODE}"}}', 90
            ):
                raise SystemExit(f"the node did not come up:\n{wout.text}\n{aout.text}")
            url = f"http://127.0.0.1:{worker_port}"
            total = args.healthy + args.fault + args.after + 5
            load = threading.Thread(target=run_load, args=(url, {"turbo": 1, "fast": 1, "relax": 2}, total))
            load.start()
            time.sleep(args.healthy)
            phases = {"before": snapshot(prom)}
            stress = subprocess.Popen(
                sb.cmd(sb.server, "stress-ng", "--cpu", "0", "--timeout", f"{args.fault}s", "--quiet")
            )
            time.sleep(args.fault - 2)
            phases["during"] = snapshot(prom)
            stress.wait(args.fault + 30)
            time.sleep(args.after)
            phases["after"] = snapshot(prom)
            load.join(total + 120)
            alerts = [(a["labels"]["alertname"], a["state"]) for a in prom.api("alerts")["alerts"]]
        print(json.dumps({"phases": phases, "alerts": alerts}, indent=2))
        for title in dict.fromkeys(t for t, _, _ in panel_queries()):
            print(f"{title}:\n" + "".join(f"  {p:<7} {phases[p].get(title, {})}\n" for p in phases), end="")
        record(
            "fault_panels",
            variant=variant_of(ap, args),
            headline="alerts: " + (", ".join(f"{name} {state}" for name, state in alerts) or "none"),
            figures=flat(phases),
            notes="no target: what the dashboard's panels say before, during and after a CPU fault (docs/service.md)",
        )
    finally:
        for proc in reversed(procs):
            stop(proc, 60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
