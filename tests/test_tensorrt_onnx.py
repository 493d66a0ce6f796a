"""ONNX export of the real tiny UNet and VAE decoder, checked on onnxruntime against torch.

This is the half of the TensorRT path that runs without a GPU: the same graphs the engine
builder parses, with the same dynamic axes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from render.backends import onnx_export  # noqa: E402
from render.backends.torch_backend import TorchBackend  # noqa: E402
from render.model import load_components  # noqa: E402

ATOL = 1e-3


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    components = load_components("tiny")
    backend = TorchBackend(components, torch.device("cpu"))
    root = tmp_path_factory.mktemp("onnx")
    unet = onnx_export.export_unet(
        components.unet, root / "unet.onnx", shape=onnx_export.ExportShape(batch=2, latent_height=32, latent_width=32)
    )
    vae = onnx_export.export_vae_decoder(
        components.vae, root / "vae.onnx", shape=onnx_export.ExportShape(batch=1, latent_height=32, latent_width=32)
    )
    sessions = {
        name: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for name, path in (("unet", unet), ("vae", vae))
    }
    return components, backend, {"unet": unet, "vae": vae}, sessions


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_graphs_are_valid_with_dynamic_axes(exported):
    _, _, paths, _ = exported
    unet = onnx.load(str(paths["unet"]), load_external_data=False)
    onnx.checker.check_model(unet)
    assert max(o.version for o in unet.opset_import if o.domain in ("", "ai.onnx")) >= 17
    inputs = {i.name: _dims(i) for i in unet.graph.input}
    assert inputs == {
        "sample": ["batch", 4, "height", "width"],
        "timestep": ["batch"],
        "encoder_hidden_states": ["batch", "text_len", 32],
    }
    assert [o.name for o in unet.graph.output] == [onnx_export.UNET_OUTPUT]
    vae = onnx.load(str(paths["vae"]), load_external_data=False)
    assert {i.name: _dims(i) for i in vae.graph.input} == {"latents": ["batch", 4, "height", "width"]}


@pytest.mark.parametrize("batch,hw", [(1, (32, 32)), (4, (32, 32)), (3, (24, 40))])
def test_unet_matches_torch_with_mixed_timesteps(exported, batch, hw):
    components, backend, _, sessions = exported
    gen = torch.Generator().manual_seed(batch)
    latents = torch.randn(batch, 4, *hw, generator=gen)
    # Mixed per-sample timesteps: jobs at different denoising steps share one UNet batch.
    timesteps = torch.tensor([999, 1, 500, 250][:batch], dtype=torch.float32)
    ehs = torch.randn(batch, 77, components.unet.config.cross_attention_dim, generator=gen)
    want = backend.predict_noise(latents, timesteps, ehs)
    got = sessions["unet"].run(
        None, {"sample": latents.numpy(), "timestep": timesteps.numpy(), "encoder_hidden_states": ehs.numpy()}
    )[0]
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)
    # The timesteps really are per sample: sample 0 alone at its own timestep gives the same row.
    if batch > 1:
        single = sessions["unet"].run(
            None,
            {
                "sample": latents[:1].numpy(),
                "timestep": timesteps[:1].numpy(),
                "encoder_hidden_states": ehs[:1].numpy(),
            },
        )[0]
        np.testing.assert_allclose(single[0], got[0], atol=ATOL, rtol=0)
        assert np.abs(got[0] - got[1]).max() > 1e-2


@pytest.mark.parametrize("batch,hw", [(1, (32, 32)), (2, (24, 40))])
def test_vae_decoder_matches_torch(exported, batch, hw):
    _, backend, _, sessions = exported
    latents = torch.randn(batch, 4, *hw, generator=torch.Generator().manual_seed(7))
    want = backend.decode(latents)
    got = sessions["vae"].run(None, {"latents": latents.numpy()})[0]
    assert got.shape == (batch, 3, hw[0] * 8, hw[1] * 8)
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)


def test_export_keeps_the_callers_module_as_it_was(exported, tmp_path):
    components, _, _, _ = exported
    before = {k: v.clone() for k, v in components.vae.state_dict().items()}
    onnx_export.export_vae_decoder(
        components.vae, tmp_path / "vae.onnx", shape=onnx_export.ExportShape(batch=1, latent_height=8, latent_width=8)
    )
    after = components.vae.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert next(components.vae.parameters()).dtype == torch.float32


def test_fp16_export_carries_its_precision_in_the_graph(exported, tmp_path):
    """What the TensorRT engine is built from: TensorRT 11 takes precision from the graph."""
    import copy

    components, backend, _, _ = exported
    path = onnx_export.export_unet(
        copy.deepcopy(components.unet).half(),
        tmp_path / "unet16.onnx",
        shape=onnx_export.ExportShape(batch=1, latent_height=16, latent_width=16),
    )
    model = onnx.load(str(path))
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert {i.name: i.type.tensor_type.elem_type for i in model.graph.input} == {
        "sample": f16,
        "timestep": f32,
        "encoder_hidden_states": f16,
    }
    assert model.graph.output[0].type.tensor_type.elem_type == f16
    gen = torch.Generator().manual_seed(16)
    x, t = torch.randn(2, 4, 32, 32, generator=gen), torch.tensor([999.0, 10.0])
    e = torch.randn(2, 77, components.unet.config.cross_attention_dim, generator=gen)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(
        None, {"sample": x.half().numpy(), "timestep": t.numpy(), "encoder_hidden_states": e.half().numpy()}
    )[0]
    np.testing.assert_allclose(got.astype(np.float32), backend.predict_noise(x, t, e).numpy(), atol=2e-2, rtol=0)
