"""CPU figures for the TensorRT path's first half: ONNX export time, and one UNet step of the
exported graph on onnxruntime (CPU) against torch eager (CPU), tiny model, side by side.

This is not a TensorRT figure (TensorRT needs an NVIDIA GPU; see bench/gpu_check.sh). It
says what the export costs and that the exported graph is a working, comparable UNet.

    flock /tmp/turbonode-bench.lock python bench/onnx_cpu.py
    python bench/onnx_cpu.py --sd15     # full-size SD-1.5 fp16 export, checked on onnxruntime
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def timed(fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def sd15_check() -> int:
    """The graph a TensorRT engine is built from, at full size: the SD-1.5 UNet exported in
    fp16 (bench/sd15.py, random weights), run on onnxruntime at a small non-square latent
    with mixed timesteps and compared with the same UNet in fp32 torch. Minutes, ~6 GB RAM."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from render.engine.backends import onnx_export

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sd15

    family = sd15.model("cpu")
    unet = family.denoiser
    with tempfile.TemporaryDirectory(prefix="turbonode-onnx-") as tmp:
        path = Path(tmp) / "unet.onnx"
        t0 = time.perf_counter()
        onnx_export.export_denoiser(family, path, rows=1, height=128, width=128, dtype=torch.float16)
        export_s = time.perf_counter() - t0
        size_gib = sum(f.stat().st_size for f in Path(tmp).iterdir()) / 2**30
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        gen = torch.Generator().manual_seed(0)
        x, t = torch.randn(2, 4, 16, 24, generator=gen), torch.tensor([999.0, 20.0])
        e = torch.randn(2, 77, sd15.UNET["cross_attention_dim"], generator=gen)
        got = session.run(
            None, {"sample": x.half().numpy(), "timestep": t.numpy(), "encoder_hidden_states": e.half().numpy()}
        )[0].astype(np.float32)
    with torch.no_grad():
        want = unet.float()(x, t, encoder_hidden_states=e, return_dict=False)[0].numpy()
    print(
        f"SD-1.5 UNet fp16 ONNX: export {export_s:.0f} s on CPU, {size_gib:.2f} GiB; onnxruntime batch 2, "
        f"latent 16x24, timesteps 999/20: max |diff| vs fp32 torch {np.abs(got - want).max():.1e} "
        f"(outputs up to {np.abs(want).max():.2f})"
    )
    from bench.record import record

    diff = float(np.abs(got - want).max())
    record(
        "onnx_cpu",
        variant="sd15",
        headline=f"SD 1.5 fp16 export {export_s:.0f} s, {size_gib:.2f} GiB; max abs diff {diff:.1e} vs fp32 torch",
        figures={"export s": round(export_s, 1), "size GiB": round(size_gib, 2), "max abs diff": diff},
        notes="no target: checks the graph a TensorRT engine is built from",
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--latent", type=int, default=32, help="latent side (image side / 8)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sd15", action="store_true", help=sd15_check.__doc__.split(".")[0])
    args = ap.parse_args(argv)
    if args.sd15:
        return sd15_check()

    import onnxruntime as ort
    import torch

    from render.engine.backends import onnx_export
    from render.engine.backends.torch_backend import TorchBackend
    from render.engine.model import load_model
    from turbonode.stats import percentile

    family = load_model("tiny")
    backend = TorchBackend(family, torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="turbonode-onnx-") as tmp:
        path = Path(tmp) / "unet.onnx"
        t0 = time.perf_counter()
        onnx_export.export_denoiser(family, path, height=args.latent * 8, width=args.latent * 8)
        export_s = time.perf_counter() - t0
        size_mib = path.stat().st_size / 2**20
        t0 = time.perf_counter()
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session_s = time.perf_counter() - t0
        print(
            f"tiny UNet, CPU ({torch.get_num_threads()} torch threads), latent {args.latent}x{args.latent} "
            f"({args.latent * 8} px), {args.iters} timed calls; torch {torch.__version__}, "
            f"onnxruntime {ort.__version__}"
        )
        print(f"ONNX export {export_s:.2f} s ({size_mib:.1f} MiB), onnxruntime session {session_s:.2f} s")
        print(
            f"{'batch':>5} | {'torch p50/p99 ms':>17} | {'onnxruntime p50/p99 ms':>23} | {'ort/torch speed':>15}"
            f" | max |diff|"
        )
        rows = []
        for batch in args.batches:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, 4, args.latent, args.latent, generator=gen)
            t = torch.linspace(999, 1, batch)
            e = torch.randn(batch, 77, family.denoiser.config.cross_attention_dim, generator=gen)
            inputs = {"sample": x, "timestep": t, "encoder_hidden_states": e}
            feeds = {k: v.numpy() for k, v in inputs.items()}
            # timed() calls the lambdas at once: they see this iteration's inputs
            torch_ms = timed(lambda: backend.predict(inputs), args.iters)  # noqa: B023
            ort_ms = timed(lambda: session.run(None, feeds), args.iters)  # noqa: B023
            diff = abs(session.run(None, feeds)[0] - backend.predict(inputs).numpy()).max()
            ratio = statistics.median(torch_ms) / statistics.median(ort_ms)
            print(
                f"{batch:>5} | {percentile(torch_ms, 50):>8.1f}/{percentile(torch_ms, 99):<8.1f} | "
                f"{percentile(ort_ms, 50):>11.1f}/{percentile(ort_ms, 99):<11.1f} | {ratio:>14.2f}x | {diff:.1e}"
            )
            quantiles = [percentile(x, q) for x in (torch_ms, ort_ms) for q in (50, 99)]
            rows.append([batch, *(None if v is None else round(v, 1) for v in quantiles)])
            rows[-1] += [round(ratio, 2), float(diff)]
    from bench.record import record, variant_of

    record(
        "onnx_cpu",
        variant=variant_of(ap, args),
        n=args.iters,
        n_per="timed calls per batch",
        headline=f"tiny UNet export {export_s:.2f} s; ort/torch "
        + ", ".join(f"batch {r[0]} {r[5]}x" for r in rows)
        + f"; max abs diff {max(r[6] for r in rows):.1e}",
        figures={"export s": round(export_s, 2), **{f"batch {r[0]} ort/torch": r[5] for r in rows}},
        table={
            "columns": [
                "batch",
                "torch p50 ms",
                "torch p99 ms",
                "ort p50 ms",
                "ort p99 ms",
                "ort/torch",
                "max abs diff",
            ],
            "rows": rows,
        },
        notes="no target: checks the export the TensorRT path builds on (not a TensorRT figure)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
