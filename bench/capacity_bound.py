"""Capacity bound: how far an ideal server could load a node under Poisson arrivals.

    .venv/bin/python bench/capacity_bound.py [--from bench/out/capacity.json] [--raw 1:5.49,2:7.27]
        [--slo 2.0] [--floor-ms 0] [--arrivals 200000]

bench/capacity.py measures the highest turbo rate the real node serves with p99 within
`worker.slo.turbo`, against the raw compute limit (the engine's images/s at its best batch
size). This script asks what no server could beat: it simulates turbo's open-loop Poisson
arrivals (a fixed seed, --arrivals per rung) against two ideal servers with no HTTP, no PNG,
no channel and no scheduling cost, and prints, rung by rung (fractions of the raw limit), the
p99 from arrival to the last image out:

  best-rate   one image at a time, each in 1/limit seconds (the best batch's per-image time
              for every image, even alone: faster than any real server, whose lone image runs
              at batch 1's slower rate)
  batching    everything waiting, up to the best batch size (the raw limit's), run together:
              B images in B / images_per_s[B] seconds, all finishing at its end

plus --floor-ms for what every answer costs beyond compute (e.g. the body's time on the link).
The capacity of each is the highest rung whose p99 <= --slo; bench/capacity.py's target (idle
capacity >= 90 % of the raw limit) is reachable only where best-rate reaches 90 %.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.capacity import IDLE_TARGET, SLO_S  # noqa: E402
from bench.record import record, variant_of  # noqa: E402
from turbonode.stats import percentile  # noqa: E402

RUNGS = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))  # 0.5 .. 1.0 of the raw limit
SEED = 23


def arrivals(rate: float, n: int, seed: int = SEED) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def best_rate(times: list[float], service_s: float) -> list[float]:
    """FIFO, one at a time, each `service_s`: each arrival's time to completion."""
    free, out = 0.0, []
    for t in times:
        free = max(free, t) + service_s
        out.append(free - t)
    return out


def batching(times: list[float], images_per_s: dict[int, float]) -> list[float]:
    """Greedy batches: when the server frees, everything that has arrived (up to the best batch
    size: a larger batch would only be slower per image) runs together for B / images_per_s[B]
    seconds."""
    largest = max(images_per_s, key=lambda b: images_per_s[b])
    out, i, free = [], 0, 0.0
    while i < len(times):
        start = max(free, times[i])
        j = i
        while j < len(times) and j - i < largest and times[j] <= start:
            j += 1
        b = j - i
        free = start + b / images_per_s[b]
        out += [free - t for t in times[i:j]]
        i = j
    return out


def bound(images_per_s: dict[int, float], slo_s: float, floor_s: float, n: int) -> dict:
    limit = max(images_per_s.values())
    rows = []
    for fraction in RUNGS:
        times = arrivals(fraction * limit, n)
        rows.append(
            {
                "fraction": fraction,
                "rate": fraction * limit,
                "best_rate_p99_s": percentile(best_rate(times, 1 / limit), 99) + floor_s,
                "batching_p99_s": percentile(batching(times, images_per_s), 99) + floor_s,
            }
        )

    def capacity(key: str) -> float | None:
        held = [r["fraction"] for r in rows if r[key] <= slo_s]
        return max(held) if held else None

    return {
        "limit": limit,
        "rows": rows,
        "capacity": {"best_rate": capacity("best_rate_p99_s"), "batching": capacity("batching_p99_s")},
    }


def _raw(text: str) -> dict[int, float]:
    try:
        out = {int(b): float(r) for b, r in (kv.split(":") for kv in text.split(",") if kv)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not B:images_per_s pairs: {text!r}") from None
    if not out or sorted(out) != list(range(1, max(out) + 1)) or min(out.values()) <= 0:
        raise argparse.ArgumentTypeError(f"want every batch size from 1 up, each at a positive rate: {text!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", metavar="JSON", help="bench/capacity.py --json output: its raw limit")
    src.add_argument("--raw", type=_raw, help="images/s per batch size, e.g. 1:5.49,2:7.27,3:7.13,4:7.13")
    ap.add_argument("--slo", type=float, default=SLO_S, help="turbo's objective, seconds (worker.slo.turbo)")
    ap.add_argument("--floor-ms", type=float, default=0.0, help="added to every answer (e.g. the body on the link)")
    ap.add_argument("--arrivals", type=int, default=200_000, help="simulated turbo arrivals per rung")
    args = ap.parse_args()
    if args.source:
        raw = json.loads(Path(args.source).read_text())["raw"]["images_per_s"]
        images_per_s = _raw(",".join(f"{b}:{r}" for b, r in raw.items()))
    else:
        images_per_s = args.raw
    if args.arrivals < 100:
        ap.error("--arrivals must be >= 100 (a p99)")
    r = bound(images_per_s, args.slo, args.floor_ms / 1000, args.arrivals)
    print(
        f"raw limit {r['limit']:.2f} images/s ({', '.join(f'b{b} {v:.2f}' for b, v in images_per_s.items())}); "
        f"turbo p99 objective {args.slo:g} s; floor {args.floor_ms:g} ms; n = {args.arrivals} arrivals per rung"
    )
    print(f"{'of raw':>6} {'rate/s':>7} {'best-rate p99 ms':>17} {'batching p99 ms':>16}")
    for row in r["rows"]:
        print(
            f"{row['fraction']:>6.0%} {row['rate']:>7.2f} {row['best_rate_p99_s'] * 1000:>17.0f}"
            f" {row['batching_p99_s'] * 1000:>16.0f}"
        )
    for name, cap in r["capacity"].items():
        got = "below 50 %" if cap is None else f"{cap:.0%} of raw"
        verdict = "reachable" if cap is not None and cap >= IDLE_TARGET else "out of reach"
        print(f"{name}: capacity {got}; the {IDLE_TARGET:.0%} target is {verdict} for this server")
    record(
        "capacity_bound",
        variant=variant_of(ap, args, ("source",)),
        n=args.arrivals,
        n_per="simulated arrivals per rung",
        headline=f"raw {r['limit']:.2f} images/s: "
        + ", ".join(f"{k} {'below 50 %' if v is None else f'{v:.0%}'} of raw" for k, v in r["capacity"].items()),
        figures={"raw limit images/s": r["limit"], **{f"{k} capacity of raw": v for k, v in r["capacity"].items()}},
        table={
            "columns": ["of raw", "rate/s", "best-rate p99 ms", "batching p99 ms"],
            "rows": [
                [
                    f"{x['fraction']:.0%}",
                    round(x["rate"], 2),
                    round(x["best_rate_p99_s"] * 1000),
                    round(x["batching_p99_s"] * 1000),
                ]
                for x in r["rows"]
            ],
        },
        notes=f"a simulation, no target of its own: is capacity's {IDLE_TARGET:.0%} target in reach of any server",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
