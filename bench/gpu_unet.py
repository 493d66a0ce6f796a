"""UNet step speed on one GPU: torch eager vs torch.compile vs TensorRT, side by side.

The UNet is Stable Diffusion 1.5's architecture built from its config with seeded random
weights (nothing can be downloaded on a lent GPU machine; the architecture, not the
weights, sets the speed). fp16, 512 px (64x64 latents), 77-token text, mixed per-sample
timesteps, batch 1/4/8 by default.

Each mode runs in its own process (`--mode`) and writes a JSON file, so a mode that fails
or runs out of time does not lose the others; `--report` prints them side by side:

    python bench/gpu_unet.py --mode eager --json /tmp/eager.json
    python bench/gpu_unet.py --mode tensorrt --json /tmp/tensorrt.json
    python bench/gpu_unet.py --report /tmp/eager.json /tmp/tensorrt.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import sd15  # bench/sd15.py and bench/runs.py, beside this script
from runs import finish

TEXT_LEN = 77
TARGET_TRT_OVER_EAGER = 1.8


def inputs(batch: int, latent: int, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(batch)
    sample = torch.randn(batch, 4, latent, latent, generator=gen, device=device, dtype=torch.float16)
    timestep = torch.linspace(999, 1, batch, device=device)  # every sample at its own step
    ehs = torch.randn(
        batch, TEXT_LEN, sd15.UNET["cross_attention_dim"], generator=gen, device=device, dtype=torch.float16
    )
    return sample, timestep, ehs


def time_calls(fn, args, iters: int, warmup: int) -> list[float]:
    """Milliseconds per call, each bracketed by CUDA events on the current stream."""
    import torch

    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def make_step(mode: str, unet, args, device):
    """(callable(sample, timestep, ehs), setup seconds, extra info) for one mode."""
    import torch

    started = time.monotonic()
    if mode == "eager":

        def step(sample, timestep, ehs):
            return unet(sample, timestep, encoder_hidden_states=ehs, return_dict=False)[0]

        return step, time.monotonic() - started, {}
    if mode == "compile":
        compiled = torch.compile(unet, mode=args.compile_mode)

        def step(sample, timestep, ehs):
            return compiled(sample, timestep, encoder_hidden_states=ehs, return_dict=False)[0]

        return step, 0.0, {"compile_mode": args.compile_mode}  # compiling happens in each batch's first call
    if mode == "tensorrt":
        from render.engine.backends.tensorrt import EngineFactory, TensorRTOptions
        from render.engine.families import PREDICTION, StableDiffusion
        from render.engine.tiny import variants as tiny

        parts = tiny.sd()  # the tiny VAE and text encoder only size the inputs; the UNet is SD-1.5's
        parts.modules["unet"], parts.fingerprint = unet, sd15.FINGERPRINT
        opts = TensorRTOptions(
            cache_dir=Path(args.cache_dir),
            max_batch=max(args.batches),
            sizes=((args.size, args.size),),
            optimization_level=args.trt_opt_level,
        )
        factory = EngineFactory(device, opts)
        runner = factory.denoiser(StableDiffusion(parts), "fp16")

        def step(sample, timestep, ehs):
            return runner(sample=sample, timestep=timestep, encoder_hidden_states=ehs)[PREDICTION]

        setup_s = time.monotonic() - started
        # Same inputs through torch: the speed is only worth reporting if the engine is right.
        check = inputs(min(4, opts.max_batch), args.size // 8, device)
        want = unet(*check[:2], encoder_hidden_states=check[2], return_dict=False)[0].float()
        err = (step(*check).float() - want).abs().max().item() / want.abs().max().item()
        print(f"tensorrt vs eager, batch {check[0].shape[0]}: max |diff| / max |eager| = {err:.2e}", flush=True)
        return (
            step,
            setup_s,
            {"tensorrt": factory.trt.__version__, "opt_level": args.trt_opt_level, "rel_err_vs_eager": f"{err:.1e}"},
        )
    raise SystemExit(f"unknown mode {mode!r}")


def run_mode(args) -> dict:
    import torch

    from turbonode.stats import percentile

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    unet = sd15.build_unet(device)
    results = []
    with torch.no_grad():  # not inference_mode: torch.compile has had trouble under it
        step, setup_s, info = make_step(args.mode, unet, args, device)
        for batch in args.batches:
            batch_started = time.monotonic()
            call_args = inputs(batch, args.size // 8, device)
            first = time.monotonic()
            step(*call_args)
            torch.cuda.synchronize()
            first_s = time.monotonic() - first
            times = time_calls(step, call_args, args.iters, args.warmup)
            mean, p50, p99 = statistics.fmean(times), percentile(times, 50), percentile(times, 99)
            results.append(
                {
                    "batch": batch,
                    "mean_ms": mean,
                    "p50_ms": p50,
                    "p99_ms": p99,
                    "unet_calls_per_s": 1000 / mean,
                    "sample_steps_per_s": batch * 1000 / mean,
                    "first_call_s": first_s,
                    "batch_wall_s": time.monotonic() - batch_started,
                }
            )
            print(
                f"{args.mode:9s} batch {batch}: {1000 / mean:7.2f} UNet calls/s "
                f"(p50 {p50:.2f} ms, p99 {p99:.2f} ms, first call {first_s:.1f} s)",
                flush=True,
            )
    return {
        "mode": args.mode,
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "size": args.size,
        "iters": args.iters,
        "setup_s": setup_s,
        "info": info,
        "results": results,
    }


def report(loaded: list[dict]) -> str:
    runs = {data["mode"]: data for data in loaded}
    order = [m for m in ("eager", "compile", "tensorrt") if m in runs]
    if "eager" not in runs:
        return "no eager run: nothing to compare against"
    any_run = runs[order[0]]
    lines = [
        f"SD-1.5 UNet (random weights), fp16, {any_run['size']} px, {any_run['gpu']} "
        f"(sm {any_run['compute_capability']}), torch {any_run['torch']}, {any_run['iters']} timed calls"
    ]
    for m in order:
        extra = ", ".join(f"{k} {v}" for k, v in runs[m]["info"].items())
        first = max(r["first_call_s"] for r in runs[m]["results"])
        lines.append(
            f"  {m}: setup {runs[m]['setup_s']:.1f} s, slowest first call {first:.1f} s"
            f"{(', ' + extra) if extra else ''}"
        )
    header = f"{'batch':>5} | " + " | ".join(f"{m + ' calls/s':>17} {'p50/p99 ms':>15}" for m in order)
    ratios = [m for m in order if m != "eager"]
    header += "".join(f" | {m + '/eager':>15}" for m in ratios)
    lines += [header, "-" * len(header)]
    eager = {r["batch"]: r for r in runs["eager"]["results"]}
    verdicts = []
    for batch in sorted(eager):
        row = f"{batch:>5} | "
        cells = []
        for m in order:
            r = next((x for x in runs[m]["results"] if x["batch"] == batch), None)
            cells.append(
                f"{r['unet_calls_per_s']:>17.2f} {r['p50_ms']:>7.2f}/{r['p99_ms']:<7.2f}"
                if r
                else f"{'-':>17} {'':>15}"
            )
        row += " | ".join(cells)
        for m in ratios:
            r = next((x for x in runs[m]["results"] if x["batch"] == batch), None)
            ratio = r["unet_calls_per_s"] / eager[batch]["unet_calls_per_s"] if r else None
            row += f" | {ratio:>14.2f}x" if ratio else f" | {'-':>15}"
            if m == "tensorrt" and ratio:
                verdicts.append(
                    f"batch {batch}: TensorRT {ratio:.2f}x eager "
                    f"({'meets' if ratio >= TARGET_TRT_OVER_EAGER else 'misses'} the "
                    f"{TARGET_TRT_OVER_EAGER}x target)"
                )
        lines.append(row)
    if "tensorrt" not in runs:
        verdicts.append("TensorRT: no result (see the log: package missing or build failed)")
    return "\n".join(lines + verdicts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("eager", "compile", "tensorrt"))
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print a side-by-side table of earlier runs")
    ap.add_argument("--json", help="write this run's figures here")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--size", type=int, default=512, help="image size in pixels (latent = size/8)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--compile-mode", default="default", help="torch.compile mode (max-autotune takes many minutes on this UNet)"
    )
    ap.add_argument("--trt-opt-level", type=int, default=3)
    ap.add_argument("--cache-dir", default="/tmp/turbonode-engines")
    args = ap.parse_args(argv)
    if not (args.mode or args.report):
        ap.error("--mode or --report is required")
    return finish(args, run_mode, report)


if __name__ == "__main__":
    sys.exit(main())
