"""Fleet SLO benchmark: turbo across three nodes behind a real HAProxy, one node impaired at a time.

    flock /tmp/turbonode-bench.lock .venv/bin/python bench/fleet_slo.py [--rate 1.5] [--requests 300]
        [--cells none,rolling] [--modes plain,turbonode] [--plain-cells rolling] [--json FILE]

The fleet (sandbox/fleet.py): three sandbox nodes, each a network namespace with its link shaped
to --link, the real worker (tiny model) and, in turbonode mode, its agent and HTB tree; each
node's processes in a cgroup of its own capped at --cpus CPUs (this VM has two cores: 3 x 0.5
leaves half a core to HAProxy, the clients and the agents, so the nodes do not simply share the
machine). Debian's HAProxy in a front namespace runs deploy/haproxy/turbonode.cfg with only the
nodes' addresses substituted. From a client namespace, through HAProxy: turbo requests open-loop
(Poisson, --rate per second over the fleet, --requests per cell, the same arrivals in every cell),
fast and relax clients closed-loop.

Cells:
  none     no fault
  rolling  each node in turn gets one fault for a window of requests / rate / nodes seconds, so
           that one node of three is impaired at every moment: node0 a GC storm in its worker
           (bench/garbage.py, re-armed every 5 s), node1 the demo's fault (stress-ng on every CPU
           in the node's cgroup + 4 bulk flows to the front), node2 its worker killed with -9 at the
           window's start and started again 2 s later by the node's supervisor (sandbox/node.py, as
           systemd's Restart=on-failure)
Modes, side by side in one run:
  plain      HAProxy round-robin with TCP checks and retries of failed connects only (plain_config of
             the shipped file), FIFO nodes (one FIFO shaped to the link), no agent, workers that
             queue whatever comes
  turbonode  the shipped file (per-tier /readyz checks, retry and redispatch of a refused or
             unanswered request, turbo weighted by each worker's agent-check), each node's agent,
             workers with worker.refuse_unready and so deadline-aware admission (worker.slo:
             bench/slo.py's objectives, turbo 2 s, fast 10 s)

Per cell and mode: fleet turbo n, p50/p99/max of the answered, turbo errors (any client-visible
answer but 200: a 5xx, a reset), SLO attainment (bench/slo.py: the share of turbo and of fast
requests answered within their objective, refused and failed ones counted as misses), the share
of turbo each node served during its own fault window and (in turbonode mode) its HAProxy turbo
weight there (the agent-check's, sampled every 0.5 s: median, and when it first fell to
WEIGHED_DOWN_PCT), fast and relax images/s, the requests HAProxy retried and the worker restarts.
Targets: turbonode's turbo p99 in `rolling` <= 1.2 x its p99 in `none`; 0 client-visible turbo errors;
turbonode's SLO attainment in every cell: turbo >= 99.9 %, fast >= 99 %.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import interval, slo  # noqa: E402
from bench.node import bench_start  # noqa: E402
from bench.node_slo import GC_REARM_S, WORKER_PY  # noqa: E402
from bench.record import judged, ms_int, record, variant_of  # noqa: E402
from sandbox import faults  # noqa: E402
from sandbox.fleet import FleetNode, FleetSettings, SandboxFleet  # noqa: E402
from sandbox.loadgen import Outcome, summarize  # noqa: E402
from sandbox.node import AgentWatch  # noqa: E402
from sandbox.settings import DemoSettings  # noqa: E402
from turbonode.errors import ControlError  # noqa: E402
from turbonode.stats import percentile  # noqa: E402
from turbonode.tiers import PROTECTED_TIER  # noqa: E402

CELLS = ("none", "rolling")
MODES = ("plain", "turbonode")
ROLLING = ("gc", "cpu+bulk", "kill")  # node i's fault in window i
TARGET_RATIO = 1.2
WEIGHED_DOWN_PCT = 3  # a node's weight at or below this: (almost) out of the turbo rotation
LEAD_S = 3.0  # the load generator starts (python, in the client namespace) before the first request
SETTLE_TIMEOUT_S = 120.0


class SloFleetNode(FleetNode):
    """A fleet node with bench/garbage.py's thread in its worker (the gc fault), as bench/node_slo.py's."""

    def _turboctl(self, *args: str) -> list[str]:
        if args[:1] != ("worker",):
            return super()._turboctl(*args)
        return [sys.executable, "-c", WORKER_PY, *args]


class WeightWatch:
    """HAProxy's turbo weight of each node (what its agent-check last set), every half second."""

    def __init__(self, fleet: SandboxFleet, start_at: float):
        self.fleet, self.start_at = fleet, start_at
        self.samples: list[dict] = []  # {"t": seconds from start_at, node: weight, ...}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.fleet.balancer is not None
        while not self._stop.wait(0.5):
            try:
                row = {n.name: self.fleet.balancer.weight("turbo", n.name) for n in self.fleet.nodes}
            except (OSError, ValueError, IndexError):
                continue
            self.samples.append({"t": round(time.monotonic() - self.start_at, 2), **row})

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


class Rolling:
    """The rolling fault: node i's fault from start_at + i * window for `window` seconds."""

    def __init__(self, nodes: list[FleetNode], start_at: float, window: float, log):
        self.nodes, self.start_at, self.window, self.log = nodes, start_at, window, log
        self.windows: list[dict] = []  # node, fault, start_s, end_s (seconds from start_at)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rolling-fault", daemon=True)

    def _run(self) -> None:
        for i, (node, fault) in enumerate(zip(self.nodes, ROLLING)):
            begin = self.start_at + i * self.window
            if self.stop.wait(max(0.0, begin - time.monotonic())):
                return
            self.log(f"  window {i}: {fault} on {node.name}")
            record = {"node": node.name, "fault": fault, "start_s": time.monotonic() - self.start_at}
            self.windows.append(record)
            end = begin + self.window
            if fault == "gc":
                while not self.stop.is_set() and time.monotonic() < end:
                    node.worker.send_signal(signal.SIGUSR1)
                    self.stop.wait(min(GC_REARM_S, max(0.0, end - time.monotonic())))
                node.worker.send_signal(signal.SIGUSR2)
            elif fault == "cpu+bulk":
                procs = faults.start(node, ("cpu", "bulk"), self.window + 5)
                self.stop.wait(max(0.0, end - time.monotonic()))
                for proc in procs:
                    node.release(proc)
            else:
                exits = len(node.worker_exits)
                record["killed_s"] = node.kill_worker() - self.start_at
                back = node.wait_back(exits + 1, max(0.0, end - time.monotonic()))
                record["back_s"] = back - self.start_at if back is not None else None
                self.stop.wait(max(0.0, end - time.monotonic()))
            record["end_s"] = time.monotonic() - self.start_at

    def __enter__(self) -> Rolling:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


def node_settings(mode: str, link: str) -> DemoSettings:
    worker = {"slo": dict(slo.OBJECTIVE_S), "refuse_unready": mode == "turbonode"}
    return DemoSettings(rate=link, worker_config=worker)


def settle(fleet: SandboxFleet, log) -> None:
    """Every worker up and idle, and HAProxy seeing each up, before a cell starts."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    for node in fleet.nodes:
        while time.monotonic() < deadline:
            try:
                tiers = node.worker_rpc.call("status")["tiers"]
                if not any(t["queued"] or t["in_flight"] for t in tiers.values()):
                    break
            except ControlError:
                pass
            time.sleep(0.5)
    assert fleet.balancer is not None
    up = {(b, n.name): "UP" for b in ("turbo", "workers") for n in fleet.nodes}
    states = fleet.balancer.wait(up, max(1.0, deadline - time.monotonic()))
    if any(not states.get(k, "").startswith("UP") for k in up):
        log(f"warning: not every server is up before the cell: {states}")


def run_cell(fleet: SandboxFleet, cell: str, mode: str, args: argparse.Namespace, log) -> dict:
    settle(fleet, log)
    assert fleet.balancer is not None
    retried_before = len(fleet.balancer.retried())
    agents, watches = [], {}
    for node in fleet.nodes:
        if mode == "plain":
            node.plain_fifo()
        else:
            agents.append((node, node.start_agent()))
    try:
        watches = {node.name: AgentWatch(node.agent_rpc) for node, _ in agents}
        start_at = time.monotonic() + LEAD_S
        weights = WeightWatch(fleet, start_at) if mode == "turbonode" else None
        window = args.requests / args.rate / len(fleet.nodes)
        rolling = Rolling(fleet.nodes, start_at, window, log)
        clients = {"fast": args.fast_clients, "relax": args.relax_clients}
        if cell == "rolling":
            with rolling:
                outcomes = fleet.load(clients, args.requests, args.rate, start_at, seed=args.seed)
        else:
            outcomes = fleet.load(clients, args.requests, args.rate, start_at, seed=args.seed)
        wall = time.monotonic() - start_at
    finally:
        weight_samples = weights.stop() if weights is not None else []
        for watch in watches.values():
            watch.stop()
        for node, agent in agents:
            node.release(agent)
        if mode == "plain":
            for node in fleet.nodes:
                node.remove_fifo()
    restarts = [  # the killed worker's: killed -> answering again (None: not within its window)
        {"node": w["node"], "down_s": round(w["back_s"] - w["killed_s"], 2) if w.get("back_s") else None}
        for w in rolling.windows
        if "killed_s" in w
    ]
    return {
        **figures(outcomes, wall, rolling.windows, weight_samples),
        "retried": fleet.balancer.retried()[retried_before:],
        "restarts": restarts,
        "agents": {name: w.summary() for name, w in watches.items()},
        "outcomes": [asdict(o) for o in outcomes],
    }


def figures(outcomes: list[Outcome], wall: float, windows: list[dict], weights: list[dict]) -> dict:
    turbo = [o for o in outcomes if o.tier == PROTECTED_TIER]
    ok = [o for o in turbo if o.status == 200]
    fast = [o for o in outcomes if o.tier == "fast"]
    latency = [o.latency for o in ok]
    tiers = summarize(outcomes, wall)
    attained = slo.attainments(outcomes)
    shares = []
    for w in windows:
        sent = [o for o in turbo if w["start_s"] <= o.sent_at < w.get("end_s", float("inf"))]
        mine = sum(o.server == w["node"] for o in sent)
        own = [x for x in weights if w["start_s"] <= x["t"] < w.get("end_s", float("inf")) and w["node"] in x]
        low = [x["t"] - w["start_s"] for x in own if x[w["node"]] <= WEIGHED_DOWN_PCT]
        shares.append(
            {
                **w,
                "turbo_sent": len(sent),
                "served_by_it": mine,
                "share": mine / len(sent) if sent else None,
                # its HAProxy weight in its window: the median, and when it first fell to a few percent
                "weight_p50": percentile([x[w["node"]] for x in own], 50),
                "weighed_down_after_s": round(low[0], 1) if low else None,
            }
        )
    return {
        "turbo": {
            "n": len(turbo),
            "ok": len(ok),
            "errors": len(turbo) - len(ok),
            "error_kinds": sorted({f"{o.status} {o.error[:80]}" for o in turbo if o.status != 200}),
            "p50_s": percentile(latency, 50),
            "p99_s": percentile(latency, 99),
            "max_s": max(latency, default=None),
            "attainment": attained[PROTECTED_TIER]["attainment"],
            "by_server": {s: sum(o.server == s for o in ok) for s in sorted({o.server for o in ok})},
        },
        "fast": {
            "n": len(fast),
            "attainment": attained["fast"]["attainment"],
            "images_per_s": (tiers.get("fast") or {}).get("images_per_s"),
        },
        "relax_images_per_s": (tiers.get("relax") or {}).get("images_per_s"),
        "slo": attained,
        "windows": shares,
        "weights": weights,
        "wall_s": wall,
    }


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def cell_slo(r: dict) -> dict:
    """A cell's attainment per tier; runs saved before it was kept give the two shares alone."""
    if "slo" in r:
        return r["slo"]
    return {
        tier: {"attainment": r[key].get("attainment")} for tier, key in ((PROTECTED_TIER, "turbo"), ("fast", "fast"))
    }


def report(result: dict) -> str:
    lines = [
        f"fleet of {result['nodes']} nodes x {result['cpus']:g} CPU behind HAProxy; turbo {result['rate']:g}/s "
        f"open-loop, {result['requests']} per cell; latency in ms from the client namespace",
        f"{'cell':<8} {'mode':<10} {'n':>4} {'p50':>6} {'p99':>6} {'max':>6} {'errors':>6} {'turbo SLO':>9} "
        f"{'fast SLO':>8} {'fast/s':>6} {'relax/s':>7} {'retried':>7}  own-window share (node: fault)",
    ]
    for cell, by_mode in result["cells"].items():
        for mode, r in by_mode.items():
            t = r["turbo"]
            shares = ", ".join(
                f"{w['node']}: {w['fault']} {_pct(w['share'])}"
                + (
                    f" (weight p50 {w['weight_p50']:.0f}, <= {WEIGHED_DOWN_PCT} after {w['weighed_down_after_s']} s)"
                    if w.get("weight_p50") is not None
                    else ""
                )
                for w in r["windows"]
            )
            lines.append(
                f"{cell:<8} {mode:<10} {t['n']:>4} {_ms(t['p50_s']):>6} {_ms(t['p99_s']):>6} {_ms(t['max_s']):>6} "
                f"{t['errors']:>6} {slo.pct(cell_slo(r)[PROTECTED_TIER]):>9} {slo.pct(cell_slo(r)['fast']):>8} "
                f"{r['fast']['images_per_s'] or 0:>6.2f} {r['relax_images_per_s'] or 0:>7.2f} "
                f"{len(r['retried']):>7}  {shares}"
            )
            if t["error_kinds"]:
                lines.append(f"{'':<20}turbo errors: {'; '.join(t['error_kinds'])}")
            if r["restarts"]:
                lines.append(
                    f"{'':<20}restarts: " + ", ".join(f"{x['node']} back after {x['down_s']} s" for x in r["restarts"])
                )
    tn = {cell: by_mode.get("turbonode", {}).get("turbo", {}) for cell, by_mode in result["cells"].items()}
    ref, rolled = (tn.get("none") or {}).get("p99_s"), (tn.get("rolling") or {}).get("p99_s")
    if ref and rolled:
        ratio = rolled / ref
        errors = tn["rolling"]["errors"]
        ends = rolling_interval(result)
        lines.append(
            f"target: turbonode rolling p99 <= {TARGET_RATIO:g} x none p99 ({_ms(ref)} ms): {ratio:.2f}x"
            f"{interval.aside(ends)} ({'met' if ratio <= TARGET_RATIO else 'missed'}); turbo errors {errors} "
            f"({'met' if errors == 0 else 'missed'})"
        )
    attained = {
        cell: cell_slo(by_mode["turbonode"]) for cell, by_mode in result["cells"].items() if "turbonode" in by_mode
    }
    if attained:
        lines.append(slo.verdict_line(slo.verdict(attained)) + " (turbonode)")
    lines.append(f"load average before: {result['loadavg_before']}, after: {result.get('loadavg_after')}")
    return "\n".join(lines)


def rolling_interval(result: dict) -> str | None:
    """The interval of turbonode's rolling p99 over its none p99 (bench/interval.py)."""
    tn = {cell: by_mode.get("turbonode") for cell, by_mode in result["cells"].items()}
    return interval.turbo_ratio_interval(tn.get("rolling"), tn.get("none"))


def result_record(result: dict) -> dict:
    """What bench/record.py keeps of a run: per cell and mode turbo n, errors, p50/p99/max and the
    SLO attainment of turbo and fast; the targets' verdicts (turbonode)."""
    rows, attained = [], {}
    for cell, by_mode in result["cells"].items():
        for mode, r in by_mode.items():
            t, att = r["turbo"], cell_slo(r)
            if mode == "turbonode":
                attained[cell] = att
            rows.append(
                [cell, mode, t["n"], t["errors"], ms_int(t["p50_s"]), ms_int(t["p99_s"]), ms_int(t["max_s"])]
                + [slo.pct(att[PROTECTED_TIER]), slo.pct(att["fast"])]
            )
    tn = {cell: by_mode["turbonode"]["turbo"] for cell, by_mode in result["cells"].items() if "turbonode" in by_mode}
    ref, rolled = (tn.get("none") or {}).get("p99_s"), (tn.get("rolling") or {}).get("p99_s")
    ratio = round(rolled / ref, 2) if ref and rolled else None
    ends = rolling_interval(result) if ratio is not None else None
    errors = (tn.get("rolling") or {}).get("errors")
    per_tier = slo.verdict(attained)
    verdicts = [
        {
            "target": f"turbonode rolling turbo p99 <= {TARGET_RATIO:g}x none",
            "value": "-" if ratio is None else f"{ratio:.2f}x{interval.aside(ends)}",
            "met": None if ratio is None else ratio <= TARGET_RATIO,
        },
        {
            "target": "0 client-visible turbo errors (turbonode, rolling)",
            "value": "-" if errors is None else str(errors),
            "met": None if errors is None else errors == 0,
        },
    ] + [
        {
            "target": f"{tier} SLO attainment >= {v['target']:.1%} within {slo.OBJECTIVE_S[tier]:g} s, every cell",
            "value": "no requests" if v["met"] is None else f"met in {v['cells'] - len(v['missed'])}/{v['cells']}",
            "met": v["met"],
        }
        for tier, v in per_tier.items()
    ]
    shown = {f"{tier} SLO {cell}": slo.pct(a[tier]) for cell, a in attained.items() for tier in slo.TIERS}
    return {
        "n": result["requests"],
        "n_per": "turbo requests per cell and mode",
        "seed": result.get("seed"),
        "headline": "turbonode "
        + ", ".join(f"{k} {v}" for k, v in shown.items())
        + (
            f"; rolling p99 {ratio:.2f}x none{interval.aside(ends)}, {errors} turbo errors" if ratio is not None else ""
        ),
        "figures": {
            **shown,
            "rolling p99 / none p99 (turbonode)": ratio,
            f"rolling p99 / none p99 {interval.LABEL}": ends,
            "turbo errors in rolling (turbonode)": errors,
        },
        "table": {
            "columns": ["cell", "mode", "turbo n", "errors", "p50 ms", "p99 ms", "max ms", "turbo SLO", "fast SLO"],
            "rows": rows,
        },
        **judged(verdicts),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {', '.join(CELLS)}")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--plain-cells",
        default="rolling",
        help="the cells the plain fleet runs (default rolling: the side by side; the target compares turbonode cells)",
    )
    ap.add_argument("--requests", type=int, default=300, help="turbo requests per cell and mode")
    ap.add_argument("--rate", type=float, default=1.5, help="turbo arrivals per second over the fleet (Poisson)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--cpus", type=float, default=0.5, help="each node's CPU quota")
    ap.add_argument("--link", default="20mbit", help="each node's link rate")
    ap.add_argument("--fast-clients", type=int, default=1)
    ap.add_argument("--relax-clients", type=int, default=2)
    ap.add_argument("--seed", type=int, default=23, help="the turbo arrivals' seed (the same in every cell)")
    ap.add_argument("--json", help="write every figure (and every request's outcome) here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the nodes' and HAProxy's logs (paths printed)")
    ap.add_argument("--report", metavar="JSON", help="print the table of a run saved with --json; run nothing")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    cells = [c for c in args.cells.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    plain_cells = [c for c in args.plain_cells.split(",") if c]
    if bad := [c for c in cells + plain_cells if c not in CELLS] + [m for m in modes if m not in MODES]:
        ap.error(f"unknown cell or mode: {', '.join(bad)}")
    if args.nodes < len(ROLLING) and "rolling" in cells:
        ap.error(f"the rolling fault needs {len(ROLLING)} nodes")
    log = bench_start()

    result: dict = {
        "cells": {},
        "nodes": args.nodes,
        "cpus": args.cpus,
        "rate": args.rate,
        "requests": args.requests,
        "link": args.link,
        "clients": {"fast": args.fast_clients, "relax": args.relax_clients},
        "seed": args.seed,
        "loadavg_before": os.getloadavg(),
    }
    try:
        for mode in modes:
            settings = FleetSettings(args.nodes, args.cpus, node_settings(mode, args.link), mode == "plain")
            settings.node.keep_logs = args.keep_logs
            with SandboxFleet(settings, log, SloFleetNode) as fleet:
                for cell in cells if mode == "turbonode" else [c for c in cells if c in plain_cells]:
                    log(f"{mode}, {cell}: {args.requests} turbo requests at {args.rate:g}/s")
                    r = run_cell(fleet, cell, mode, args, log)
                    result["cells"].setdefault(cell, {})[mode] = r
                    t = r["turbo"]
                    log(f"  turbo n={t['n']} p50={_ms(t['p50_s'])} p99={_ms(t['p99_s'])} ms errors={t['errors']}")
    finally:
        result["loadavg_after"] = os.getloadavg()
        if args.json:  # also what a failed or interrupted run measured so far
            Path(args.json).write_text(json.dumps(result, indent=1))
    print(report(result))
    record("fleet_slo", variant=variant_of(ap, args), **result_record(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
