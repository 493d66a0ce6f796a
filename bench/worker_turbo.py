"""Turbo latency through the whole worker (front and engine process) on loopback, per checkout,
side by side: what the front <-> engine channel costs a turbo request, idle and in a GC storm.

    .venv/bin/python bench/worker_turbo.py --trees /path/to/other/checkout,. \\
        [--requests 100] [--rounds 5] [--json FILE]

Each checkout's worker runs at once (`turboctl worker run --model tiny`, its own code first on
PYTHONPATH, this interpreter's packages), with bench/garbage.py's thread in its front process as
bench/node_slo.py installs it. This process sends turbo requests one at a time (256x256, the
family's turbo steps: bench/node_slo.py's probe) and measures each from send to last byte. Cells:
`idle`, then `gc` (the garbage thread makes cyclic garbage in that front while its requests
run). Rounds alternate the checkouts in blocks, so a drift of the machine hits each alike. Per
checkout and cell: n, p50/p99/max, and the split of p50/p99 between the engine (submit to
finished, from the answer) and the front (the rest: HTTP, the channel, the answer), and the share of
the cell's time the worker's collections paused it (the front's and the engine's, from its /metrics:
in a storm, the time the front's event loop cannot run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.node import WORKER_PY, free_port  # noqa: E402
from bench.record import flat, record, variant_of  # noqa: E402
from render.front.metrics import GC_PAUSE  # noqa: E402
from sandbox.loadgen import Outcome, request_image  # noqa: E402
from turbonode.stats import percentile  # noqa: E402

CELLS = ("idle", "gc")
SIZE = 256
GC_REARM_S = 5.0  # bench/garbage.py stops a burst after 10 s
GAP_S = 0.05  # between requests: each finds the worker idle
START_TIMEOUT_S = 180.0


class Worker:
    """A checkout's worker, listening on loopback."""

    def __init__(self, tree: Path, scratch: Path):
        self.tree = tree
        self.label = f"{tree.name} ({_commit(tree)})"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = ["worker", "run", "--model", "tiny", "--listen", f"127.0.0.1:{port}"]
        argv += ["--control", str(scratch / f"{port}.sock")]
        self.log = scratch / f"{port}.log"
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
        env.update(PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", WORKER_PY, *argv], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "serving http" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the worker of {self.tree} did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def garbage(self, on: bool) -> None:
        self.proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _commit(tree: Path) -> str:
    git = ["git", "-C", str(tree)]
    out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True)
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def gc_paused_s(url: str) -> float:
    """Seconds the worker's collections have paused it so far (the sum of its GC pause histogram)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == GC_PAUSE
        for sample in family.samples
        if sample.name == GC_PAUSE + "_sum"
    )


@dataclass
class Block:
    outcomes: list[Outcome]
    wall_s: float
    gc_paused_s: float


def block(worker: Worker, n: int, gc: bool) -> Block:
    outcomes = []
    armed = 0.0
    paused, started = gc_paused_s(worker.url), time.monotonic()
    for _ in range(n):
        if gc and time.monotonic() - armed > GC_REARM_S:
            worker.garbage(True)
            armed = time.monotonic()
        outcomes.append(request_image(worker.url, "turbo", SIZE))
        time.sleep(GAP_S)
    if gc:
        worker.garbage(False)
    return Block(outcomes, time.monotonic() - started, gc_paused_s(worker.url) - paused)


def summary(blocks: list[Block]) -> dict:
    outcomes = [o for b in blocks for o in b.outcomes]
    ok = [o for o in outcomes if o.status == 200 and o.elapsed_s is not None]
    total = [o.latency for o in ok]
    engine = [o.elapsed_s for o in ok]
    front = [o.latency - o.elapsed_s for o in ok]  # type: ignore[operator]
    ms = lambda xs, q: round(percentile(xs, q) * 1000, 1) if xs else None  # noqa: E731
    return {
        "n": len(ok),
        "failed": len(outcomes) - len(ok),
        "p50": ms(total, 50),
        "p99": ms(total, 99),
        "max": round(max(total) * 1000, 1) if total else None,
        "engine": (ms(engine, 50), ms(engine, 99)),
        "front": (ms(front, 50), ms(front, 99)),
        "in_gc": round(sum(b.gc_paused_s for b in blocks) / sum(b.wall_s for b in blocks), 3),
    }


def run(trees: list[Path], requests: int, rounds: int, start: Callable[[Path, Path], Worker] = Worker) -> dict:
    """Each checkout's worker (`start`) is stopped at the end, also when a later one fails to start."""
    # the workers' sockets and logs; a worker that does not start has its log's tail printed
    with tempfile.TemporaryDirectory(prefix="turbonode-bench-") as scratch, contextlib.ExitStack() as started:
        workers = []
        for tree in trees:
            workers.append(start(tree, Path(scratch)))
            started.callback(workers[-1].stop)
        return _run(workers, requests, rounds)


def _run(workers: list[Worker], requests: int, rounds: int) -> dict:
    for worker in workers:
        worker.wait_serving()
    for worker in workers:  # warm: the first requests trace nothing, but fill caches
        block(worker, 5, gc=False)
    per_round = max(1, requests // rounds)
    results: dict = {}
    for cell in CELLS:
        blocks: dict[str, list[Block]] = {w.label: [] for w in workers}
        for _ in range(rounds):
            for worker in workers:
                blocks[worker.label].append(block(worker, per_round, gc=cell == "gc"))
        results[cell] = {label: summary(got) for label, got in blocks.items()}
    return {"size": SIZE, "requests": requests, "rounds": rounds, "cells": results}


def table(result: dict) -> str:
    lines = [
        f"turbo {result['size']}x{result['size']} on loopback, one request at a time; ms (send to last byte)",
        f"{'cell':6} {'checkout':28} {'n':>4} {'p50':>7} {'p99':>7} {'max':>7}"
        f"  {'engine p50/p99':>15}  {'front p50/p99':>14}  {'in GC':>6}",
    ]
    for cell, rows in result["cells"].items():
        for label, r in rows.items():
            failed = f"  ({r['failed']} failed)" if r["failed"] else ""
            engine, front = "/".join(map(str, r["engine"])), "/".join(map(str, r["front"]))
            in_gc = f"{r['in_gc']:.1%}" if "in_gc" in r else "-"  # runs before it was measured
            lines.append(
                f"{cell:6} {label:28} {r['n']:>4} {r['p50']:>7} {r['p99']:>7} {r['max']:>7}  {engine:>15}  {front:>14}"
                f"  {in_gc:>6}" + failed
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=".", help="comma-separated checkouts to compare (default: this one)")
    ap.add_argument("--requests", type=int, default=100, help="turbo requests per checkout and cell")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per checkout and cell, alternating checkouts")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--report", metavar="JSON", help="print the table of a run saved with --json; run nothing")
    args = ap.parse_args()
    if args.report:
        print(table(json.loads(Path(args.report).read_text())))
        return 0
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    result = run(trees, args.requests, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    record(
        "worker_turbo",
        variant=variant_of(ap, args, ("trees",)),
        n=args.requests,
        n_per="turbo requests per checkout and cell",
        headline="turbo p50/p99 ms: "
        + ", ".join(
            f"{cell} {label} {r['p50']}/{r['p99']}"
            for cell, rows in result["cells"].items()
            for label, r in rows.items()
        ),
        figures=flat(result["cells"]),
        notes="no target of its own: checkouts side by side (--trees)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
