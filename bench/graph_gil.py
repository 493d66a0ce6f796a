"""One denoiser step and one VAE decode, eager vs traced graph, quiet vs next to a GC storm, side by side.

The GC storm is bench/garbage.py's thread inside this process, as node_slo.py puts it into the
worker: full collections over a rolling window of cyclic garbage, each holding the GIL for tens
of milliseconds. An eager forward gives the GIL up and takes it back at every op, so each op can
wait behind a collection; a traced graph (render/engine/backends/graphs.py) takes it back once per call.
Tiny model (SD 1.x), 256 px, 2 rows (one turbo image with classifier-free guidance), the
worker's default threads and wait policy, the loaded heap frozen as the worker freezes it:

    flock /tmp/turbonode-bench.lock .venv/bin/python bench/graph_gil.py
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

# Run from a checkout: this tree's packages win over an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from render.cpu_threads import available_cpus, default_threads, wait_policy_default  # noqa: E402

WAIT_POLICY = wait_policy_default()  # as the worker daemon does, before torch (OpenMP) loads

import torch  # noqa: E402

from bench.garbage import Garbage  # noqa: E402
from render.engine.backends.select import make_backend  # noqa: E402
from render.engine.model import load_model  # noqa: E402
from render.gc_telemetry import freeze_after_load  # noqa: E402
from turbonode.stats import percentile  # noqa: E402

STORM_SETTLE_S = 0.5  # the garbage window fills before timing starts


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _ms(samples: list[float], q: float) -> float:
    value = percentile(samples, q)
    assert value is not None  # n >= 1
    return 1e3 * value


def main() -> int:
    from bench.record import record, variant_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--size", type=int, default=0, help="pixels (0: the model's native size)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("-n", type=int, default=100, help="timed calls per cell (p99 needs >= 100)")
    args = ap.parse_args()
    threads = default_threads(available_cpus())
    torch.set_num_threads(threads)
    family = load_model(args.model)
    size = args.size or family.native_size
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(s, generator=gen) for n, s in family.input_shapes(args.rows, size, size).items()}
    latents = torch.randn(1, *family.noise_shape(size, size)[1:], generator=gen)
    backends = {
        "eager": make_backend("torch", family, "cpu", torch_graphs=False),
        "graph": make_backend("torch", family, "cpu"),
    }
    for backend in backends.values():
        backend.prepare(size, size)  # as the worker does at start: traces the graph backend's default size
    freeze_after_load()  # as the worker does once its model is loaded: collections skip the model's objects
    garbage = Garbage().install()
    rows = []
    for mode, backend in backends.items():
        for what, call in (("step", partial(backend.predict, inputs)), ("decode", partial(backend.decode, latents))):
            for _ in range(3):  # warm: traces, allocator, profiling runs
                call()
            quiet = timed(call, args.n)
            garbage.burst(3600)  # for as long as this cell takes
            time.sleep(STORM_SETTLE_S)
            try:
                storm = timed(call, args.n)
            finally:
                garbage.stop()
            time.sleep(STORM_SETTLE_S)
            rows.append((what, mode, quiet, storm))
    rows.sort(key=lambda r: r[0] != "step")
    print(
        f"{family.name} {size}px, {args.rows} rows, {threads} intra-op threads, OMP_WAIT_POLICY={WAIT_POLICY}, "
        f"n={args.n} per cell (ms)"
    )
    print(f"{'':7}{'':6}{'quiet p50':>10}{'p99':>8}{'storm p50':>11}{'p99':>8}{'max':>8}{'p99 storm/quiet':>17}")
    table = []
    for what, mode, quiet, storm in rows:
        q50, q99, s50, s99 = (_ms(xs, p) for xs in (quiet, storm) for p in (50, 99))
        print(f"{what:7}{mode:6}{q50:10.1f}{q99:8.1f}{s50:11.1f}{s99:8.1f}{1e3 * max(storm):8.1f}{s99 / q99:16.2f}x")
        table.append([what, mode, *(round(x, 1) for x in (q50, q99, s50, s99, 1e3 * max(storm))), round(s99 / q99, 2)])
    record(
        "graph_gil",
        variant=variant_of(ap, args),
        n=args.n,
        n_per="timed calls per cell",
        headline="step p99 under the storm: " + ", ".join(f"{r[1]} {r[5]} ms" for r in table if r[0] == "step"),
        figures={f"{r[0]} {r[1]} storm p99 ms": r[5] for r in table},
        table={
            "columns": ["call", "mode", "quiet p50 ms", "p99", "storm p50 ms", "p99", "max", "p99 storm/quiet"],
            "rows": table,
        },
        notes="no target: it backs worker.torch_graphs",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
