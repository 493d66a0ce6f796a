"""Capacity benchmark: the highest turbo arrival rate one node serves within its objective.

    /work/helpers/machine exclusive .venv/bin/python bench/capacity.py [--cpus 0.5] [--requests 100]
        [--conditions idle,fault,fault-plain] [--json FILE]
    (to iterate: --rungs 0.7,0.9 runs just those rungs, --raw-limit 6.9 skips measuring the raw limit)

One node as bench/fleet_slo.py runs three of them (sandbox/fleet.py: its own network namespace,
its link shaped to --link, its cgroup capped at --cpus CPUs with the worker in it), the client
in the namespace at the other end of its link sending straight to the worker (no balancer: the
node's own capacity). Turbo requests only, open-loop (Poisson), the rate in rungs that are
fractions of the node's raw compute limit, >= --requests per rung: up from RUNGS' first until a
rung's turbo p99 exceeds worker.slo.turbo (every request counts: one refused or failed counts as
REQUEST_TIMEOUT_S), down from it (to 10 %) until one holds when the first does not. The capacity
is the highest rung that held, for each condition:

  idle         the node with turbonode (agent, eBPF classifier under the HTB tiers), no fault
  fault        the demo's fault (stress-ng on every CPU in the node's cgroup + 4 bulk flows), turbonode
  fault-plain  the same fault on the plain node (one FIFO shaped to the link, no agent)

The raw compute limit: the worker's own engine (render/engine/host.py `build`, from the node's
configuration) run in a process of its own in the node's worker cgroup: B turbo jobs submitted
at once and run to the end, again and again, for B = 1 .. worker.max_batch; images/s of the best
B. No HTTP, no PNG, no queueing: what the denoiser and the VAE give at best. It runs as the
engine process does: same configuration, quota, intra-op threads (render/cpu_threads.py's default
for the quota) and OMP_WAIT_POLICY; its CPU ms per image are printed per B.

Where the capacity goes, per rung (sandbox/worker_cpu.py): CPU ms per image answered in the
engine's render loop (denoise and decode), the engine process's other threads (PNG encoding, the
channel to the front) and the front (HTTP), images per denoiser step and per VAE decode actually
formed, and the seconds the node's quota throttled it; with the agent, what it engaged.

Targets: idle capacity >= 90 % of the raw limit; under the fault with turbonode >= 80 % of idle.
The node's worker exports the figure once configured (worker.capacity.turbo) beside its served
rate (docs/fleet.md says what reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.node import bench_start  # noqa: E402
from bench.record import judged, ms_int, record, variant_of  # noqa: E402
from bench.slo import OBJECTIVE_S  # noqa: E402
from sandbox import faults  # noqa: E402
from sandbox.fleet import FleetNet, FleetNode  # noqa: E402
from sandbox.loadgen import Outcome  # noqa: E402
from sandbox.node import REQUEST_TIMEOUT_S, AgentWatch  # noqa: E402
from sandbox.report import describe_agent  # noqa: E402
from sandbox.settings import DemoSettings  # noqa: E402
from sandbox.worker_cpu import Reading, engine_counters, split, thread_cpu, throttled  # noqa: E402
from turbonode.stats import percentile  # noqa: E402
from turbonode.tiers import PROTECTED_TIER  # noqa: E402

CONDITIONS = ("idle", "fault", "fault-plain")
FAULT = ("cpu", "bulk")  # the demo's (sandbox/demo.py)
RUNGS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # fractions of the raw limit, up from the first
# Down from RUNGS[0] when it does not hold, until one holds (the fault conditions' held rate lies
# there; 100 requests at 10 % take about 2.5 minutes); below the last, "below the lowest rung".
LOWER_RUNGS = (0.3, 0.2, 0.1)
IDLE_TARGET, FAULT_TARGET = 0.9, 0.8
RAW_SECONDS = 8.0  # per batch size, after a warm-up round
SLO_S = OBJECTIVE_S[PROTECTED_TIER]
WARMUP_S = 3.0  # the fault runs this long before the first request

# Runs in the node's worker cgroup: the worker's engine as `build` makes it, driven in-process.
RAW = r"""
import json, os, sys, time
from render.cpu_threads import wait_policy_default
wait_policy_default()  # as the engine process does: before torch loads
from turbonode.config import load_config
from render.engine.host import build
from render.jobs import JobRequest
cfg = load_config(sys.argv[1]).worker
seconds = float(sys.argv[2])
engine, info = build(cfg, None, None, lambda what: None)
size, steps = info["defaults"]["size"], info["defaults"]["steps"]["turbo"]
guidance = info["defaults"]["guidance"]["turbo"]
out, cpu = {}, {}
for batch in range(1, cfg.max_batch + 1):
    def round_():
        jobs = [engine.submit(JobRequest("a turbo tier test image", "turbo", steps, i, guidance, size, size))
                for i in range(batch)]
        while not all(j.state.terminal for j in jobs):
            engine.run_once()
        assert all(j.state.value == "done" for j in jobs), [j.error for j in jobs]
    round_()  # warm: the prompt's encoding cached, this batch size's graph traced
    t0, c0, images = time.monotonic(), time.process_time(), 0
    while time.monotonic() - t0 < seconds:
        round_()
        images += batch
    out[batch] = images / (time.monotonic() - t0)
    cpu[batch] = (time.process_time() - c0) * 1000 / images
print(json.dumps({"images_per_s": out, "cpu_ms_per_image": cpu, "steps": steps, "size": size,
                  "threads": engine.intra_op_threads, "wait_policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


def raw_limit(node: FleetNode) -> dict:
    """The engine's images/s per batch size, in the node's worker cgroup (the worker idles)."""
    argv = node.in_cgroup(node.worker_cgroup, [sys.executable, "-c", RAW, str(node.config), str(RAW_SECONDS)])
    res = subprocess.run(argv, env=node.env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"the raw-limit process failed: {res.stderr.strip()[-2000:]}")
    raw = json.loads(res.stdout.strip().splitlines()[-1])
    best = max(raw["images_per_s"].items(), key=lambda kv: kv[1])
    return {**raw, "best_batch": int(best[0]), "limit": best[1]}


def rung(outcomes: list[Outcome], wall: float) -> dict:
    """One rung's figures: p50/p99 over every turbo request (a refusal or failure as REQUEST_TIMEOUT_S)."""
    turbo = [o for o in outcomes if o.tier == PROTECTED_TIER]
    latency = [o.latency if o.status == 200 else float(REQUEST_TIMEOUT_S) for o in turbo]
    ok = sum(o.status == 200 for o in turbo)
    return {
        "n": len(turbo),
        "ok": ok,
        "p50_s": percentile(latency, 50),
        "p99_s": percentile(latency, 99),
        "within_slo": sum(o.status == 200 and o.latency <= SLO_S for o in turbo) / len(turbo) if turbo else None,
        "served_per_s": ok / wall if wall else None,
    }


def sweep(node: FleetNode, condition: str, limit: float, requests: int, log, only: tuple[float, ...] = ()) -> dict:
    """Up the rungs until one does not hold (down first when the lowest does not); each rung's
    figures. `only`: just these rungs, each run whatever the others gave (no capacity figure)."""
    rungs: dict[str, dict] = {}

    def run(fraction: float) -> bool:
        rate = fraction * limit
        log(f"{condition}: {requests} turbo requests at {rate:.2f}/s ({fraction:.0%} of the raw limit)")
        r = run_rung(node, condition, rate, requests)
        rungs[f"{fraction:g}"] = {"rate": rate, **r}
        log(f"  p50 {_ms(r['p50_s'])} p99 {_ms(r['p99_s'])} ms, {r['ok']}/{r['n']} answered")
        return r["p99_s"] is not None and r["p99_s"] <= SLO_S

    held = None
    if only:
        for fraction in only:
            run(fraction)
        return {"rungs": rungs, "capacity_fraction": None, "capacity": None}
    if run(RUNGS[0]):
        held = RUNGS[0]
        for fraction in RUNGS[1:]:
            if not run(fraction):
                break
            held = fraction
    else:
        for fraction in LOWER_RUNGS:
            if run(fraction):
                held = fraction
                break
    return {"rungs": rungs, "capacity_fraction": held, "capacity": held * limit if held else None}


def run_rung(node: FleetNode, condition: str, rate: float, requests: int) -> dict:
    started = []
    if condition != "idle":
        started = faults.start(node, FAULT, requests / rate * 2 + 60)
        time.sleep(WARMUP_S)
    watch = AgentWatch(node.agent_rpc) if condition != "fault-plain" else None
    try:
        before = reading(node)
        outcomes, wall = node.load({}, requests, rate)
        after = reading(node)
        capped = _capped(node) if watch is not None else None
    finally:
        if watch is not None:
            watch.stop()
        for proc in started:
            node.release(proc)
    r = rung(outcomes, wall)
    agent = {**watch.summary(), "quota_neighbours": capped} if watch else None
    return {**r, "cpu": split(before, after, r["ok"]), "agent": agent}


def _capped(node: FleetNode) -> dict | None:
    """What cpu_share capped under the node's quota at the end of the rung (None: not engaged)."""
    lever = node.agent_rpc.call("status").get("actions", {}).get("levers", {}).get("cpu_share") or {}
    return lever.get("quota_neighbours") if lever.get("engaged") else None


def reading(node: FleetNode) -> Reading:
    """The worker's CPU per thread, the node's throttling and the engine's counters, now."""
    front, engine = node.worker_rpc.call("status")["pids"]
    sb = node.sandbox
    page = subprocess.run(
        sb.cmd(sb.client, "curl", "-sf", f"http://{node.address}/metrics"),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert node.cgroups is not None  # a FleetNode has them
    return Reading(
        {"front": thread_cpu(front), "engine": thread_cpu(engine)},
        throttled(node.cgroups, node.top_cgroup),
        engine_counters(page, PROTECTED_TIER),
    )


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _f(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def report(result: dict) -> str:
    raw = result["raw"]
    lines = [
        f"raw compute limit: {raw['limit']:.2f} images/s (given with --raw-limit, not measured)"
        if raw["best_batch"] is None
        else f"raw compute limit: {raw['limit']:.2f} images/s at batch {raw['best_batch']} "
        f"({', '.join(f'b{b} {v:.2f}' for b, v in raw['images_per_s'].items())}); "
        f"turbo {raw['steps']} steps at {raw['size']} px, node of {result['cpus']:g} CPU, "
        f"{raw.get('threads')} intra-op thread(s), OMP_WAIT_POLICY {raw.get('wait_policy')}; CPU ms per image "
        + ", ".join(f"b{b} {v:.0f}" for b, v in raw.get("cpu_ms_per_image", {}).items()),
        f"{'condition':<12} {'rate/s':>7} {'of raw':>6} {'n':>4} {'ok':>4} {'p50 ms':>7} {'p99 ms':>7} {'in SLO':>7}",
    ]
    for condition, r in result["conditions"].items():
        for fraction, x in r["rungs"].items():
            lines.append(
                f"{condition:<12} {x['rate']:>7.2f} {float(fraction):>6.0%} {x['n']:>4} {x['ok']:>4} "
                f"{_ms(x['p50_s']):>7} {_ms(x['p99_s']):>7} {(x['within_slo'] or 0):>7.1%}"
            )
    lines.append(
        "where the worker's CPU went, per image answered: ms of CPU in the engine's render loop (denoise, "
        "decode), its other threads (PNG, channel), the front (HTTP); images per step and per decode; "
        "step and decode wall ms per image; seconds the node's quota throttled it"
    )
    lines.append(
        f"{'condition':<12} {'of raw':>6} {'loop':>5} {'other':>5} {'front':>5} {'img/step':>8} {'img/dec':>7} "
        f"{'step':>5} {'decode':>6} {'thrott':>6}"
    )
    for condition, r in result["conditions"].items():
        for fraction, x in r["rungs"].items():
            c = x.get("cpu") or {}
            lines.append(
                f"{condition:<12} {float(fraction):>6.0%} {_f(c.get('engine_loop_ms')):>5} "
                f"{_f(c.get('engine_other_ms')):>5} {_f(c.get('front_ms')):>5} {_f(c.get('images_per_step'), 2):>8} "
                f"{_f(c.get('images_per_decode'), 2):>7} {_f(c.get('step_wall_ms')):>5} "
                f"{_f(c.get('decode_wall_ms')):>6} {_f(c.get('throttled_s'), 1):>6}"
            )
    for condition, r in result["conditions"].items():
        for fraction, x in r["rungs"].items():
            if x.get("agent"):
                capped = x["agent"].get("quota_neighbours")
                lines.append(
                    f"agent, {condition} {float(fraction):.0%}: {describe_agent(x['agent'])}"
                    + (f"; quota neighbours capped at the end: {capped}" if capped else "")
                )
    cap = {c: r["capacity"] for c, r in result["conditions"].items()}
    lines.append(
        "capacity (highest rate with turbo p99 <= "
        f"{SLO_S:g} s): " + ", ".join(f"{c} {v:.2f}/s" if v else f"{c} below the lowest rung" for c, v in cap.items())
    )
    for i, v in enumerate(verdicts(result)):
        lines.append(
            f"target {v['target']}: {v['value']} ({'met' if v['met'] else 'missed'})"
            + (
                f"; fault-plain {(cap.get('fault-plain') or 0) / cap['idle']:.0%} of idle"
                if i == 1 and "fault-plain" in cap
                else ""
            )
        )
    return "\n".join(lines)


def verdicts(result: dict) -> list[dict]:
    """The targets: idle capacity against the raw limit, then the fault's against idle."""
    cap, limit = {c: r["capacity"] for c, r in result["conditions"].items()}, result["raw"]["limit"]
    if not cap.get("idle"):
        return []
    out = [{"target": f"idle >= {IDLE_TARGET:.0%} of raw", "value": f"{cap['idle'] / limit:.0%}"}]
    out[0]["met"] = cap["idle"] >= IDLE_TARGET * limit
    if "fault" in cap:
        share = (cap["fault"] or 0) / cap["idle"]
        out.append({"target": f"fault (turbonode) >= {FAULT_TARGET:.0%} of idle", "value": f"{share:.0%}"})
        out[1]["met"] = share >= FAULT_TARGET
    return out


def result_record(result: dict) -> dict:
    """What bench/record.py keeps of a run: the raw limit, each condition's capacity, every rung."""
    limit = result["raw"]["limit"]
    found = verdicts(result)
    cap = {c: r["capacity"] for c, r in result["conditions"].items()}
    return {
        "n": result["requests"],
        "n_per": "turbo requests per rung",
        "headline": f"raw {limit:.2f} images/s; "
        + ", ".join(f"{c} {'-' if v is None else f'{v / limit:.0%} of raw'}" for c, v in cap.items()),
        "figures": {"raw limit images/s": limit, **{f"{c} capacity /s": v for c, v in cap.items()}},
        "table": {
            "columns": ["condition", "rate/s", "of raw", "n", "ok", "p50 ms", "p99 ms", "in SLO"],
            "rows": [
                [c, round(x["rate"], 2), f"{float(f):.0%}", x["n"], x["ok"], ms_int(x["p50_s"]), ms_int(x["p99_s"])]
                + ["-" if x["within_slo"] is None else f"{x['within_slo']:.1%}"]
                for c, r in result["conditions"].items()
                for f, x in r["rungs"].items()
            ],
        },
        **judged(found),
        "target": f"idle capacity >= {IDLE_TARGET:.0%} of raw; fault (turbonode) >= {FAULT_TARGET:.0%} of idle",
    }


def _fractions(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of fractions: {text!r}") from None
    if not all(0 < x <= 2 for x in out):
        raise argparse.ArgumentTypeError(f"rungs are fractions of the raw limit in (0, 2]: {text!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help=f"comma-separated, from {', '.join(CONDITIONS)}")
    ap.add_argument("--cpus", type=float, default=0.5, help="the node's CPU quota (bench/fleet_slo.py's per node)")
    ap.add_argument("--requests", type=int, default=100, help="turbo requests per rung (>= 100 for a p99)")
    ap.add_argument("--link", default="20mbit", help="the node's link rate")
    ap.add_argument(
        "--raw-limit", type=float, help="images/s to take as the raw limit instead of measuring it (to iterate)"
    )
    ap.add_argument("--rungs", type=_fractions, default=(), help="only these rungs (e.g. 0.7,0.9), no sweep")
    ap.add_argument(
        "--neighbour-share",
        type=float,
        help="the node agent's levers.quota_neighbour_share (default: the config's; 0: the ablation without it)",
    )
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--report", metavar="JSON", help="print the table of a run saved with --json; run nothing")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    conditions = [c for c in args.conditions.split(",") if c]
    if bad := [c for c in conditions if c not in CONDITIONS]:
        ap.error(f"unknown condition: {', '.join(bad)}")
    log = bench_start()

    result: dict = {
        "cpus": args.cpus,
        "requests": args.requests,
        "link": args.link,
        "neighbour_share": args.neighbour_share,
        "conditions": {},
    }
    result["loadavg_before"] = os.getloadavg()
    with FleetNet(1) as net:
        levers = "" if args.neighbour_share is None else f"quota_neighbour_share = {args.neighbour_share}\n"
        node = FleetNode(DemoSettings(rate=args.link, extra_toml=levers), net.link(0), "node0", args.cpus, log)
        with node:
            result["raw"] = (
                {"limit": args.raw_limit, "best_batch": None, "images_per_s": {}, "steps": None, "size": None}
                if args.raw_limit
                else raw_limit(node)
            )
            log(f"raw compute limit: {result['raw']['limit']:.2f} images/s at batch {result['raw']['best_batch']}")
            try:
                for condition in conditions:
                    if condition == "fault-plain":
                        node.plain_fifo()
                        agent = None
                    else:
                        agent = node.start_agent()
                    try:
                        result["conditions"][condition] = sweep(
                            node, condition, result["raw"]["limit"], args.requests, log, args.rungs
                        )
                    finally:
                        if agent is not None:
                            node.release(agent)
                        else:
                            node.remove_fifo()
            finally:
                result["loadavg_after"] = os.getloadavg()
                if args.json:
                    Path(args.json).write_text(json.dumps(result, indent=1))
    print(report(result))
    record("capacity", variant=variant_of(ap, args), **result_record(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
