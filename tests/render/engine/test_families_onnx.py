"""ONNX export of each family's denoiser and decoder, checked on onnxruntime against torch.

The half of the TensorRT path that runs without a GPU: the SD 1.x UNet, the SDXL UNet with
its added inputs, the SD3 and Flux transformers (Flux-dev with its guidance input), exported
once with dynamic batch, latent size and text length, then fed the real batched inputs the
family builds for images of mixed progress, prompts and guidance at sizes other than the
traced one; the decoders with their scaling and shift.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.render.helpers import SIZE, family, guidance_for, start

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from render.engine.backends import onnx_export  # noqa: E402
from render.engine.backends.torch_backend import TorchBackend  # noqa: E402

ATOL = 1e-4
NAMES = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-flux-dev")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    out = {}
    for name in NAMES:
        path = onnx_export.export_denoiser(family(name), root / f"{name}.onnx", rows=2, height=SIZE, width=SIZE)
        out[name] = (path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    return out


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _run(session, inputs):
    return session.run(None, {k: v.numpy() for k, v in inputs.items()})[0]


def _mixed_batch(fam, height, width):
    """Images at different progress, prompts and guidance; one with classifier-free guidance where it applies."""
    g = guidance_for(fam)
    batch = [
        start(fam, "a red cat", seed=1, steps=4, guidance=g, size=width, height=height),
        start(fam, "a boat", seed=2, steps=6, guidance=g * 1.5, size=width, height=height),
        start(fam, "a tree", seed=3, steps=3, guidance=0.0, size=width, height=height),
    ]
    batch[1].step = 2  # a later timestep than the others: per-row timesteps
    return batch


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("height,width", [(SIZE, SIZE), (SIZE * 2, SIZE + 32)])
def test_denoiser_matches_torch_on_real_mixed_batches(exported, name, height, width):
    fam = family(name)
    _, session = exported[name]
    inputs = fam.denoiser_inputs(_mixed_batch(fam, height, width))
    assert [i.name for i in session.get_inputs()] == list(fam.input_names) == list(inputs)
    with torch.inference_mode():
        want = fam.denoiser_module().call(inputs)
    got = _run(session, inputs)
    assert got.shape == tuple(want.shape) == tuple(inputs["sample"].shape)
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)
    # row 0 alone gives the same row: nothing in the graph mixes rows
    shared = set(fam.shared_axes)
    single = {k: v if k in shared else v[:1] for k, v in inputs.items()}
    np.testing.assert_allclose(_run(session, single)[0], got[0], atol=ATOL, rtol=0)
    assert np.abs(got[0] - got[-1]).max() > 1e-3  # rows differ: timesteps and conditioning reach the graph


def test_graph_inputs_name_the_added_conditioning(exported):
    graphs = {name: onnx.load(str(exported[name][0]), load_external_data=False) for name in NAMES}
    for graph in graphs.values():
        onnx.checker.check_model(graph)
        assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= onnx_export.OPSET
        assert [o.name for o in graph.graph.output] == ["prediction"]
        # TensorRT-friendly: no float64 anywhere
        assert not any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.DOUBLE for n in graph.graph.node)
    inputs = {name: {i.name: _dims(i) for i in g.graph.input} for name, g in graphs.items()}
    assert inputs["tiny"] == {
        "sample": ["batch", 4, "height", "width"],
        "timestep": ["batch"],
        "encoder_hidden_states": ["batch", "text_len", 32],
    }
    assert inputs["tiny-sdxl"] == {
        **inputs["tiny"],
        "encoder_hidden_states": ["batch", "text_len", 64],
        "text_embeds": ["batch", 32],
        "time_ids": ["batch", 6],
    }
    assert inputs["tiny-sd3"]["sample"] == ["batch", 16, "height", "width"]
    assert inputs["tiny-sd3"]["pooled_projections"] == ["batch", 64]
    assert inputs["tiny-flux-dev"] == {
        "sample": ["batch", "image_len", 64],
        "timestep": ["batch"],
        "encoder_hidden_states": ["batch", "text_len", 32],
        "pooled_projections": ["batch", 32],
        "img_ids": ["image_len", 3],
        "txt_ids": ["text_len", 3],
        "guidance": ["batch"],
    }
    assert "guidance" not in inputs["tiny-flux"]


@pytest.mark.parametrize("name", ["tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux"])
def test_decoder_applies_scale_and_shift_like_the_torch_backend(name, tmp_path):
    fam = family(name)
    path = onnx_export.export_decoder(fam, tmp_path / "vae.onnx")
    graph = onnx.load(str(path))
    assert {i.name: _dims(i) for i in graph.graph.input} == {
        "latents": ["batch", fam.latent_channels, "height", "width"]
    }
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    latents = torch.randn(2, fam.latent_channels, 8, 12, generator=torch.Generator().manual_seed(5))
    want = TorchBackend(fam, torch.device("cpu")).decode(latents)
    got = session.run(None, {"latents": latents.numpy()})[0]
    assert got.shape == (2, 3, 64, 96)
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)


def test_large_graphs_keep_their_weights_in_one_external_file(tmp_path):
    """Over the threshold (2 GiB+ graphs for real SDXL/Flux; forced here), weights go to <name>.onnx.data."""
    fam = family("tiny-flux")
    path = onnx_export.export_denoiser(fam, tmp_path / "flux.onnx", height=SIZE, width=SIZE, external_data_threshold=0)
    data = onnx_export.external_data_path(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.onnx", "flux.onnx.data"]
    weights = sum(p.numel() * p.element_size() for p in fam.denoiser.parameters())
    assert data.stat().st_size >= weights * 0.9
    graph = onnx.load(str(path), load_external_data=False)
    inline = [
        t.name
        for t in graph.graph.initializer
        if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > 1024
    ]
    assert not inline  # every tensor over 1 KiB lives in the one data file
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = fam.denoiser_inputs(_mixed_batch(fam, SIZE, SIZE))
    with torch.inference_mode():
        want = fam.denoiser_module().call(inputs)
    np.testing.assert_allclose(_run(session, inputs), want.numpy(), atol=ATOL, rtol=0)
    # a re-export below the threshold replaces both files with one self-contained graph
    onnx_export.export_denoiser(fam, path, height=SIZE, width=SIZE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.onnx"]


@pytest.mark.parametrize("name", ["tiny", "tiny-sdxl"])
def test_fp16_export_carries_its_precision_and_keeps_the_callers_module(name, tmp_path):
    """What a TensorRT engine is built from: TensorRT 11 takes precision from the graph."""
    fam = family(name)
    before = {k: v.clone() for k, v in fam.denoiser.state_dict().items()}
    path = onnx_export.export_denoiser(fam, tmp_path / "half.onnx", height=SIZE, width=SIZE, dtype=torch.float16)
    graph = onnx.load(str(path))
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    types = {i.name: i.type.tensor_type.elem_type for i in graph.graph.input}
    assert types == {n: f32 if n in ("timestep", "time_ids") else f16 for n in fam.input_names}
    assert graph.graph.output[0].type.tensor_type.elem_type == f16
    assert all(torch.equal(before[k], v) for k, v in fam.denoiser.state_dict().items())
    assert next(fam.denoiser.parameters()).dtype == torch.float32
    inputs = fam.denoiser_inputs(_mixed_batch(fam, SIZE, SIZE))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(
        None, {k: v.numpy().astype(np.float16 if types[k] == f16 else np.float32) for k, v in inputs.items()}
    )
    with torch.inference_mode():
        want = fam.denoiser_module().call(inputs)
    np.testing.assert_allclose(got[0].astype(np.float32), want.numpy(), atol=3e-2, rtol=0)
