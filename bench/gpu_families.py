"""SDXL-sized and Flux-sized denoiser step speed on one GPU, through the worker's family interface.

The denoisers are the real architectures built from their configs with seeded random weights
(nothing can be downloaded on a lent GPU machine; the architecture sets the speed): SDXL's
UNet (fp16, with its added text_embeds/time_ids) and FLUX.1-schnell's transformer (bf16, 12 B
parameters, 2x2-packed latents, 256 text tokens). Each call is one batched step of rows at
mixed per-row timesteps, built as the worker builds them (render/engine/families: `Denoiser`,
`input_shapes`), eager torch. One family per process (`--family`), one JSON each; `--report`
prints them side by side:

    python bench/gpu_families.py --family sdxl --json /tmp/sdxl.json
    python bench/gpu_families.py --family flux --json /tmp/flux.json
    python bench/gpu_families.py --report /tmp/sdxl.json /tmp/flux.json

`--dry-run` runs the same code on the CPU with the tiny variants (a check that the script
works where no GPU is: CI, a laptop); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first

from runs import finish

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the parts that set the architecture)
SDXL_UNET = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280),
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "attention_head_dim": (5, 10, 20),
    "transformer_layers_per_block": (1, 2, 10),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
# black-forest-labs/FLUX.1-schnell transformer/config.json
FLUX_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
FULL = {
    "sdxl": ("tiny-sdxl", "unet", SDXL_UNET, "float16"),
    "flux": ("tiny-flux", "transformer", FLUX_TRANSFORMER, "bfloat16"),
}
FLUX_TEXT_LEN = 512  # the tokenizer's length; FLUX.1-schnell then takes 256 (render/engine/families/flux.py)


def build_family(name: str, device, dry_run: bool):
    """The family with a full-size random denoiser (tiny text encoders and VAE: they only size the inputs)."""
    import torch

    from render.engine.families import family_for
    from render.engine.tiny import BUILDERS

    tiny_name, denoiser, config, dtype = FULL[name]
    parts = BUILDERS[tiny_name]()
    if not dry_run:
        from diffusers import FluxTransformer2DModel, UNet2DConditionModel

        cls = UNet2DConditionModel if name == "sdxl" else FluxTransformer2DModel
        torch.manual_seed(0)
        with torch.device(device):  # initialise on the GPU: billions of parameters are slow on a CPU
            module = cls(**config)
        parts.modules[denoiser] = module.to(dtype=getattr(torch, dtype)).eval().requires_grad_(False)
        if name == "flux":
            parts.modules["tokenizer_2"].model_max_length = FLUX_TEXT_LEN
    return family_for(parts.pipeline_class)(parts)


def timer(device):
    """(start, stop -> ms): CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    if device.type == "cuda":

        def start():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            return s, e

        def stop(t):
            t[1].record()
            t[1].synchronize()
            return t[0].elapsed_time(t[1])

        return start, stop
    return time.perf_counter, lambda t0: 1000 * (time.perf_counter() - t0)


def run(args) -> dict:
    import torch

    from render.engine.backends.onnx_export import example_inputs
    from turbonode.stats import percentile

    device = torch.device("cpu" if args.dry_run else "cuda")
    started = time.monotonic()
    fam = build_family(args.family, device, args.dry_run)
    module = fam.denoiser_module()
    dtype = next(module.parameters()).dtype
    params = sum(p.numel() for p in module.parameters())
    setup_s = time.monotonic() - started
    size = 64 if args.dry_run else args.size
    start, stop = timer(device)
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            call_args = example_inputs(fam, rows, size, size, device, dtype)  # per-row timesteps 999..1
            first = time.monotonic()
            module(*call_args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.monotonic() - first
            for _ in range(args.warmup):
                module(*call_args)
            times = []
            for _ in range(args.iters):
                t = start()
                module(*call_args)
                times.append(stop(t))
            mean, p50, p99 = statistics.fmean(times), percentile(times, 50), percentile(times, 99)
            results.append(
                {
                    "rows": rows,
                    "mean_ms": mean,
                    "p50_ms": p50,
                    "p99_ms": p99,
                    "calls_per_s": 1000 / mean,
                    "row_steps_per_s": rows * 1000 / mean,
                    "first_call_s": first_s,
                }
            )
            print(
                f"{args.family} rows {rows}: {1000 / mean:7.2f} calls/s, {rows * 1000 / mean:7.2f} row-steps/s "
                f"(p50 {p50:.1f} ms, p99 {p99:.1f} ms)",
                flush=True,
            )
    return {
        "family": args.family,
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "params": params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "iters": args.iters,
        "setup_s": setup_s,
        "results": results,
        "inputs": list(fam.input_names),
    }


def report(loaded: list[dict]) -> str:
    if not loaded:
        return "no family runs to report"
    lines = [
        (
            f"{'family':>6} {'params':>8} {'dtype':>9} {'px':>5} {'rows':>4} | {'calls/s':>8} {'row-steps/s':>11} "
            f"{'p50 ms':>8} {'p99 ms':>8}"
        )
    ]
    lines.append("-" * len(lines[0]))
    for run_ in loaded:
        for r in run_["results"]:
            lines.append(
                f"{run_['family']:>6} {run_['params'] / 1e6:7.0f}M {run_['dtype']:>9} {run_['size']:>5} "
                f"{r['rows']:>4} | {r['calls_per_s']:8.2f} {r['row_steps_per_s']:11.2f} {r['p50_ms']:8.1f} "
                f"{r['p99_ms']:8.1f}"
            )
    devices = sorted({r["device"] for r in loaded})
    return "\n".join(
        [f"random-weight denoisers through render/engine/families, eager torch, {', '.join(devices)}", *lines]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=tuple(FULL))
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print a side-by-side table of earlier runs")
    ap.add_argument("--json", help="write this run's figures here")
    ap.add_argument(
        "--rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4],
        help="denoiser rows per call (an image with classifier-free guidance takes two)",
    )
    ap.add_argument("--size", type=int, default=1024, help="image size in pixels")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="tiny variants on the CPU: checks the script, not speed")
    args = ap.parse_args(argv)
    if not (args.family or args.report):
        ap.error("--family or --report is required")
    return finish(args, run, report)


if __name__ == "__main__":
    sys.exit(main())
