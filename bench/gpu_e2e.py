"""End-to-end turbo latency through the worker's engine on one GPU, per backend.

The worker's real engine (render.engine.scheduler: text encoder + cache, per-job schedulers, batched
UNet steps, VAE decode to uint8 pixels) on SD-1.5-sized components with random weights
(bench/sd15.py), 512 px, turbo = 4 steps without guidance. Two figures per backend:

- idle: one turbo job at a time on an idle worker;
- loaded: turbo jobs arriving while relax jobs (25 steps, guidance 7.5) fill the batch.

    python bench/gpu_e2e.py --backend torch --json /tmp/e2e-torch.json
    python bench/gpu_e2e.py --report /tmp/e2e-torch.json /tmp/e2e-tensorrt.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import sd15  # bench/sd15.py and bench/runs.py, beside this script
from runs import finish


def request(tier: str, i: int, size: int):
    from render.jobs import JobRequest

    if tier == "turbo":
        return JobRequest(
            prompt=f"a lighthouse at dusk, take {i}",
            tier="turbo",
            steps=4,
            seed=i,
            guidance=0.0,
            width=size,
            height=size,
        )
    return JobRequest(
        prompt=f"a slow oil painting {i}", tier="relax", steps=25, seed=1000 + i, guidance=7.5, width=size, height=size
    )


def latencies(engine, n: int, background: int, size: int) -> list[float]:
    """Seconds from submit to decoded image for n turbo jobs, `background` relax jobs running meanwhile."""
    relax, out = [], []
    for i in range(n):
        relax = [j for j in relax if not j.future.done()]
        relax += [engine.submit(request("relax", i * background + k, size)) for k in range(background - len(relax))]
        if background:
            time.sleep(0.2)  # the relax jobs fill the batch before the turbo job arrives
        job = engine.submit(request("turbo", i, size))
        job.future.result(timeout=120)
        out.append(job.finished - job.submitted)
    for job in relax:
        engine.cancel(job.id)
    return out


def run(args) -> dict:
    import torch

    from render.engine.backends.select import make_backend
    from render.engine.backends.tensorrt import TensorRTOptions
    from render.engine.encode_prompt import PromptEncoder
    from render.engine.scheduler import Engine, EngineSettings
    from turbonode.stats import percentile

    if args.model == "tiny":  # the embedded model: checks this script anywhere, CPU included
        from render.engine.model import load_model

        family = load_model("tiny")
    else:
        family = sd15.model(torch.device(args.device))
    size = family.native_size
    started = time.monotonic()
    options = TensorRTOptions(cache_dir=Path(args.cache_dir), max_batch=args.max_batch, sizes=((size, size),))
    backend = make_backend(args.backend, family, args.device, tensorrt_options=options)
    backend.prepare(size, size)  # as the worker does at start (torch: its traced graphs)
    device = backend.device
    setup_s = time.monotonic() - started
    engine = Engine(
        backend, PromptEncoder(family, device, backend.dtype), family, EngineSettings(max_batch=args.max_batch)
    ).start()
    try:
        latencies(engine, 2, 0, size)  # warm-up: cuDNN/cuBLAS plans, allocator, first scheduler
        idle = latencies(engine, args.jobs, 0, size)
        loaded = latencies(engine, args.jobs, args.background, size)
    finally:
        engine.stop()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {
        "backend": backend.name,
        "model": args.model,
        "size": size,
        "where": where,
        "setup_s": setup_s,
        "max_batch": args.max_batch,
        "background_relax_jobs": args.background,
    }
    for name, values in (("idle", idle), ("loaded", loaded)):
        result[name] = {"n": len(values), "p50_s": percentile(values, 50), "p99_s": percentile(values, 99)}
        print(
            f"{backend.name:8s} turbo {name:6s}: p50 {percentile(values, 50) * 1000:7.1f} ms, "
            f"p99 {percentile(values, 99) * 1000:7.1f} ms ({len(values)} jobs)",
            flush=True,
        )
    return result


def report(rows: list[dict]) -> str:
    if not rows:
        return "no end-to-end results"
    r0 = rows[0]
    lines = [
        f"end-to-end turbo latency, {r0['model']} model, {r0['size']} px, 4 steps, worker engine, {r0['where']}",
        f"{'backend':>9} | {'idle p50/p99 ms':>17} | {'under relax load p50/p99 ms':>28} | setup s",
    ]
    for r in rows:
        lines.append(
            f"{r['backend']:>9} | {r['idle']['p50_s'] * 1e3:>8.1f}/{r['idle']['p99_s'] * 1e3:<8.1f} | "
            f"{r['loaded']['p50_s'] * 1e3:>13.1f}/{r['loaded']['p99_s'] * 1e3:<14.1f} | {r['setup_s']:.0f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("torch", "tensorrt"), default="torch")
    ap.add_argument("--report", nargs="+", metavar="JSON")
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--background", type=int, default=6, help="relax jobs kept running under the loaded figure")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--model", choices=("sd15", "tiny"), default="sd15", help="tiny: the embedded model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cache-dir", default="/tmp/turbonode-engines")
    return finish(ap.parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
