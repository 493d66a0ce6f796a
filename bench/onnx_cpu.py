"""CPU figures for the TensorRT path's first half: ONNX export time, and one UNet step of the
exported graph on onnxruntime (CPU) against torch eager (CPU), tiny model, side by side.

This is not a TensorRT figure (TensorRT needs an NVIDIA GPU; see bench/gpu_check.sh). It
says what the export costs and that the exported graph is a working, comparable UNet.

    flock /tmp/turbonode-bench.lock python bench/onnx_cpu.py
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--latent", type=int, default=32, help="latent side (image side / 8)")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)

    import onnxruntime as ort
    import torch

    from render.backends import onnx_export
    from render.backends.torch_backend import TorchBackend
    from render.engine import percentile
    from render.model import load_components

    comps = load_components("tiny")
    backend = TorchBackend(comps, torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="turbonode-onnx-") as tmp:
        path = Path(tmp) / "unet.onnx"
        t0 = time.perf_counter()
        onnx_export.export_unet(comps.unet, path, shape=onnx_export.ExportShape(latent_height=args.latent,
                                                                                 latent_width=args.latent))
        export_s = time.perf_counter() - t0
        size_mib = path.stat().st_size / 2**20
        t0 = time.perf_counter()
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session_s = time.perf_counter() - t0
        print(f"tiny UNet, CPU ({torch.get_num_threads()} torch threads), latent {args.latent}x{args.latent} "
              f"({args.latent * 8} px), {args.iters} timed calls; torch {torch.__version__}, "
              f"onnxruntime {ort.__version__}")
        print(f"ONNX export {export_s:.2f} s ({size_mib:.1f} MiB), onnxruntime session {session_s:.2f} s")
        print(f"{'batch':>5} | {'torch p50/p99 ms':>17} | {'onnxruntime p50/p99 ms':>23} | {'ort/torch speed':>15}"
              f" | max |diff|")
        for batch in args.batches:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, 4, args.latent, args.latent, generator=gen)
            t = torch.linspace(999, 1, batch)
            e = torch.randn(batch, 77, comps.unet.config.cross_attention_dim, generator=gen)
            feeds = {"sample": x.numpy(), "timestep": t.numpy(), "encoder_hidden_states": e.numpy()}
            torch_ms = timed(lambda: backend.predict_noise(x, t, e), args.iters)
            ort_ms = timed(lambda: session.run(None, feeds), args.iters)
            diff = abs(session.run(None, feeds)[0] - backend.predict_noise(x, t, e).numpy()).max()
            ratio = statistics.median(torch_ms) / statistics.median(ort_ms)
            print(f"{batch:>5} | {percentile(torch_ms, 50):>8.1f}/{percentile(torch_ms, 99):<8.1f} | "
                  f"{percentile(ort_ms, 50):>11.1f}/{percentile(ort_ms, 99):<11.1f} | {ratio:>14.2f}x | {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
