"""The embedded tiny model (SD 1.x) and the torch backend (real diffusers modules).

Loading directories of every family: tests/render/engine/test_families_loading.py."""

from __future__ import annotations

import pytest
import torch

from render.engine.backends.select import BackendUnavailable, make_backend
from render.engine.tiny import components as tiny
from tests.render.helpers import family


@pytest.fixture(scope="module")
def components():
    return family("tiny")


def test_tiny_is_a_real_sd_component_set(components):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = components.module("tokenizer")
    assert components.name == "sd" and components.model_id == "tiny"
    assert isinstance(components.denoiser, UNet2DConditionModel)
    assert isinstance(components.vae, AutoencoderKL)
    assert isinstance(components.module("text_encoder"), CLIPTextModel)
    assert isinstance(tokenizer, CLIPTokenizer)
    assert tokenizer.model_max_length == 77
    assert list(components.denoiser.config.block_out_channels) == [32, 64]
    assert components.denoiser.config.cross_attention_dim == 32
    assert components.vae_scale_factor == 8 and components.size_multiple == 16 and components.native_size == 256
    ids = tokenizer(["a red cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    assert ids.shape == (1, 77)
    assert len(set(ids[0, :10].tolist())) > 3  # the prompt's bytes became distinct tokens


def test_tiny_weights_are_deterministic(components):
    again = tiny.build_unet()
    for (name, a), b in zip(components.denoiser.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    state = torch.random.get_rng_state()
    tiny.build_vae()
    assert torch.equal(state, torch.random.get_rng_state())  # building leaves the caller's RNG alone


def test_torch_backend_shapes_and_per_sample_timesteps(components):
    backend = make_backend("torch", components, "cpu")
    assert backend.describe() == {
        "name": "torch",
        "device": "cpu",
        "dtype": "float32",
        "execution": "graph",
        "graphs": 0,
    }
    backend.prepare(128, 128)  # the worker prepares its default size: one denoiser and one decoder graph
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    emb = torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(1)).expand(2, -1, -1)

    def predict(rows):
        return backend.predict(
            {"sample": latents[rows], "timestep": torch.tensor([900.0, 20.0])[rows], "encoder_hidden_states": emb[rows]}
        )

    both = predict(slice(0, 2))
    assert both.shape == latents.shape
    # each row is computed with its own timestep: row 1 equals a batch-of-one call at t=20
    single = predict(slice(1, 2))
    torch.testing.assert_close(both[1:], single, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(both[0], single[0], atol=1e-3)
    assert backend.decode(latents).shape == (2, 3, 128, 128)
    assert backend.describe()["graphs"] == 2  # the denoiser's graph took both row counts


def test_backend_selection_errors(components):
    with pytest.raises(BackendUnavailable, match="tensorrt"):
        make_backend("tensorrt", components, "cpu")
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        make_backend("onnx", components, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no CUDA"):
            make_backend("torch", components, "cuda")
