"""The torch backend on a CUDA GPU (fp16). Skips where torch sees no GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch sees none)"),
]


def test_engine_on_cuda_fp16_renders_and_reports_gpu_memory():
    from render.engine.backends.select import make_backend
    from render.engine.encode_prompt import PromptEncoder
    from render.engine.model import load_model
    from render.engine.scheduler import Engine
    from render.front.control_server import ControlHandlers
    from render.gc_telemetry import GcMonitor
    from tests.render.helpers import drain, req

    family = load_model("tiny")  # its own copy: the backend moves modules to the GPU in place
    backend = make_backend("auto", family, "auto")
    assert backend.device.type == "cuda" and backend.describe()["dtype"] == "float16"
    engine = Engine(backend, PromptEncoder(family, backend.device, backend.dtype), family)
    jobs = [
        engine.submit(req("relax", seed=3)),
        engine.submit(req("turbo", seed=3)),
        engine.submit(req("relax", seed=3)),
    ]
    drain(engine, jobs)
    a, _, c = (j.samples[0].image for j in jobs)
    assert a.shape == (64, 64, 3) and np.abs(a.astype(int) - c.astype(int)).max() <= 2
    st = ControlHandlers(engine, GcMonitor()).status()
    assert st["memory"]["gpu_allocated_bytes"] > 0


def test_traced_graphs_on_cuda_render_what_eager_renders():
    from render.engine.backends.select import make_backend
    from render.engine.model import load_model

    family = load_model("tiny")
    eager = make_backend("torch", family, "cuda", torch_graphs=False)
    graphs = make_backend("torch", family, "cuda")
    graphs.prepare(64, 64)
    assert graphs.describe()["graphs"] == 2
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(s, generator=gen) for n, s in family.input_shapes(3, 64, 64).items()}
    torch.testing.assert_close(graphs.predict(inputs), eager.predict(inputs), atol=2e-2, rtol=2e-2)
    latents = torch.randn(2, *family.noise_shape(64, 64)[1:], generator=gen)
    torch.testing.assert_close(graphs.decode(latents), eager.decode(latents), atol=2e-2, rtol=2e-2)
