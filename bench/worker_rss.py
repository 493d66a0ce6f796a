"""The engine process's resident memory under sustained load, per checkout, side by side: a
worker serves requests for minutes, and its RSS must level off, not grow with every request.

    .venv/bin/python bench/worker_rss.py --trees /path/to/other/checkout,. [--seconds 120] [--size 256] [--json FILE]

Each checkout's worker (`turboctl worker run --model tiny` on loopback, bench/worker_turbo.py's
Worker) runs in turn under closed-loop clients, one per tier and a second relax one (`--size`,
default bench/node_slo.py's 256x256; the tiers' default steps), for `--seconds`; the engine
process's RSS is read every SAMPLE_S from /proc. Per checkout: requests served, RSS at the start
(after warming) and at the end, its growth per 1,000 requests and over the last half of the run
(where a bounded heap is flat).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import flat, record, variant_of  # noqa: E402
from bench.worker_turbo import SIZE, Worker  # noqa: E402
from render.link import ENTRY  # noqa: E402
from sandbox.loadgen import request_image  # noqa: E402

SAMPLE_S = 10.0
CLIENTS = ("turbo", "fast", "relax", "relax")


def engine_rss_mib(worker: Worker) -> int:
    """The engine process's RSS (the front's child running render.engine.host)."""
    for child in Path(f"/proc/{worker.proc.pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if ENTRY.encode() in cmdline:
                return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 // 2**20
    raise SystemExit(f"no engine process under the worker of {worker.tree}")


def load(worker: Worker, seconds: float, size: int) -> dict:
    stop, served, failed = threading.Event(), [0], [0]

    def client(tier: str) -> None:
        while not stop.is_set():
            ok = request_image(worker.url, tier, size).status == 200
            served[0] += ok
            failed[0] += not ok

    for _ in range(3):  # warm: traced graphs, caches
        request_image(worker.url, "turbo", size)
    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t in CLIENTS]
    samples = [(0.0, 0, engine_rss_mib(worker))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while time.monotonic() - t0 < seconds:
        time.sleep(SAMPLE_S)
        samples.append((round(time.monotonic() - t0, 1), served[0], engine_rss_mib(worker)))
    stop.set()
    for t in threads:
        t.join(60)
    half = [s for s in samples if s[0] >= seconds / 2]
    return {
        "served": served[0],
        "failed": failed[0],
        "samples": samples,
        "rss_start_mib": samples[0][2],
        "rss_end_mib": samples[-1][2],
        "growth_mib_per_1000": round((samples[-1][2] - samples[0][2]) * 1000 / max(1, served[0]), 1),
        "growth_last_half_mib": half[-1][2] - half[0][2] if half else None,
    }


def table(result: dict) -> str:
    lines = [
        f"engine RSS under {len(CLIENTS)} closed-loop clients, {result['size']}x{result['size']}, "
        f"for {result['seconds']} s (MiB)",
        f"{'checkout':30} {'served':>7} {'failed':>6} {'start':>6} {'end':>6} {'per 1000 req':>13} {'last half':>10}",
    ]
    for label, r in result["trees"].items():
        lines.append(
            f"{label:30} {r['served']:>7} {r['failed']:>6} {r['rss_start_mib']:>6} {r['rss_end_mib']:>6}"
            f" {r['growth_mib_per_1000']:>13} {r['growth_last_half_mib']:>10}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=".", help="comma-separated checkouts to compare (default: this one)")
    ap.add_argument("--seconds", type=float, default=120.0, help="load per checkout")
    ap.add_argument("--size", type=int, default=SIZE, help="image size in pixels")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="turbonode-bench-"))
    result: dict = {"seconds": args.seconds, "size": args.size, "trees": {}}
    for tree in [Path(t).resolve() for t in args.trees.split(",")]:
        worker = Worker(tree, scratch)
        try:
            worker.wait_serving()
            result["trees"][worker.label] = load(worker, args.seconds, args.size)
        finally:
            worker.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    record(
        "worker_rss",
        variant=variant_of(ap, args, ("trees",)),
        headline="engine RSS growth per 1000 requests: "
        + ", ".join(f"{label} {r['growth_mib_per_1000']} MiB" for label, r in result["trees"].items()),
        figures=flat(result["trees"]),
        target="the engine's RSS levels off under load",
        notes="met is judged by reading the growth (per 1000 requests, last half of the run)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
