"""The embedded tiny model, model loading and the torch backend (real diffusers modules)."""

from __future__ import annotations

import json

import pytest
import torch

from render import tiny
from render.backends.select import BackendUnavailable, make_backend
from render.model import ModelError, load_components


@pytest.fixture(scope="module")
def components():
    return load_components("tiny")


def test_tiny_is_a_real_sd_component_set(components):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    assert isinstance(components.unet, UNet2DConditionModel)
    assert isinstance(components.vae, AutoencoderKL)
    assert isinstance(components.text_encoder, CLIPTextModel)
    assert isinstance(components.tokenizer, CLIPTokenizer)
    assert components.tokenizer.model_max_length == 77
    assert list(components.unet.config.block_out_channels) == [32, 64]
    assert components.unet.config.cross_attention_dim == 32
    assert components.vae_scale_factor == 8
    ids = components.tokenizer(["a red cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    assert ids.shape == (1, 77)
    assert len(set(ids[0, :10].tolist())) > 3  # the prompt's bytes became distinct tokens


def test_tiny_weights_are_deterministic(components):
    again = tiny.build_unet()
    for (name, a), b in zip(components.unet.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    state = torch.random.get_rng_state()
    tiny.build_vae()
    assert torch.equal(state, torch.random.get_rng_state())  # building leaves the caller's RNG alone


def test_torch_backend_shapes_and_per_sample_timesteps(components):
    backend = make_backend("torch", components, "cpu")
    assert backend.describe() == {"name": "torch", "device": "cpu", "dtype": "float32"}
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    emb = torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(1)).expand(2, -1, -1)
    both = backend.predict_noise(latents, torch.tensor([900.0, 20.0]), emb)
    assert both.shape == latents.shape
    # each row is computed with its own timestep: row 1 equals a batch-of-one call at t=20
    single = backend.predict_noise(latents[1:], torch.tensor([20.0]), emb[1:])
    torch.testing.assert_close(both[1:], single, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(both[0], single[0], atol=1e-3)
    assert backend.decode(latents).shape == (2, 3, 128, 128)


def test_backend_selection_errors(components):
    with pytest.raises(BackendUnavailable, match="tensorrt"):
        make_backend("tensorrt", components, "cpu")
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        make_backend("onnx", components, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no CUDA"):
            make_backend("torch", components, "cuda")


def test_load_components_rejects_bad_dirs(tmp_path):
    with pytest.raises(ModelError, match="neither 'tiny' nor a directory"):
        load_components(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="model_index.json"):
        load_components(str(tmp_path))
    (tmp_path / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusionXLPipeline",
                "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            }
        )
    )
    with pytest.raises(ModelError, match="SDXL"):
        load_components(str(tmp_path))


def test_load_components_from_a_saved_directory(components, tmp_path):
    """A diffusers directory saved from the tiny set loads back with local files only."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        unet=components.unet,
        vae=components.vae,
        text_encoder=components.text_encoder,
        tokenizer=components.tokenizer,
        scheduler=DDIMScheduler.from_config(components.scheduler_config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(tmp_path)
    loaded = load_components(str(tmp_path))
    assert loaded.model_id == str(tmp_path.resolve())
    assert loaded.native_size == 256
    assert loaded.scheduler_config["beta_schedule"] == "scaled_linear"
    for a, b in zip(components.unet.state_dict().values(), loaded.unet.state_dict().values()):
        assert torch.equal(a, b)
    assert loaded.fingerprint == load_components(str(tmp_path)).fingerprint
