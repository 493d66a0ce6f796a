"""What each family feeds its denoiser: SDXL's pooled embeddings and time ids, SD3's three encoders,
Flux's packed latents, position ids and guidance embedding, and each family's samplers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from render.engine.families import family_for
from render.engine.families.base import FamilyError
from render.engine.families.flux import image_ids, pack, unpack
from tests.render.helpers import SIZE, family, start


def test_sdxl_pools_the_second_encoder_and_zeroes_the_empty_prompt():
    fam = family("tiny-sdxl")
    cat, empty = fam.encode_prompts(["a red cat", ""])
    te1, te2 = fam.module("text_encoder"), fam.module("text_encoder_2")
    assert cat["encoder_hidden_states"].shape == (77, te1.config.hidden_size + te2.config.hidden_size)
    assert cat["text_embeds"].shape == (te2.config.projection_dim,)
    assert cat["text_embeds"].abs().max() > 0
    # force_zeros_for_empty_prompt (SDXL's default): the empty negative prompt conditions on zeros
    assert not empty["encoder_hidden_states"].any() and not empty["text_embeds"].any()
    parts = dataclasses.replace(fam.parts, pipeline_config={"force_zeros_for_empty_prompt": False})
    assert family_for("StableDiffusionXLPipeline")(parts).encode_prompts([""])[0]["text_embeds"].any()


def test_sdxl_rows_carry_pooled_embeddings_and_time_ids():
    fam = family("tiny-sdxl")
    cfg, plain = start(fam, "a red cat", guidance=5.0), start(fam, "a boat", guidance=0.0)
    inputs = fam.denoiser_inputs([cfg, plain])
    assert (
        list(inputs)
        == list(fam.input_names)
        == ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
    )
    assert inputs["sample"].shape == (3, 4, SIZE // 8, SIZE // 8)  # uncond + cond rows, then one row
    assert torch.equal(inputs["time_ids"], torch.tensor([[SIZE, SIZE, 0, 0, SIZE, SIZE]] * 3, dtype=torch.float32))
    assert not inputs["text_embeds"][0].any()  # the zeroed negative
    assert torch.equal(inputs["text_embeds"][1], cfg.cond["text_embeds"])
    assert torch.equal(inputs["text_embeds"][2], plain.cond["text_embeds"])


def test_sd3_joins_clip_and_t5_and_runs_without_t5():
    with_t5, without = family("tiny-sd3"), family("tiny-sd3-no-t5")
    a, b = with_t5.encode_prompts(["a red cat"])[0], without.encode_prompts(["a red cat"])[0]
    joint = with_t5.denoiser.config.joint_attention_dim
    assert a["encoder_hidden_states"].shape == (77 + with_t5.t5_length, joint)
    assert b["encoder_hidden_states"].shape == (77 + 256, joint)  # the pipeline's zeros stand in for T5
    assert not b["encoder_hidden_states"][77:].any() and a["encoder_hidden_states"][77:].any()
    clip_width = 2 * with_t5.module("text_encoder").config.hidden_size
    assert not a["encoder_hidden_states"][:77, clip_width:].any()  # CLIP zero-padded to T5's width
    assert a["pooled_projections"].shape == (2 * with_t5.module("text_encoder").config.projection_dim,)
    torch.testing.assert_close(a["pooled_projections"], b["pooled_projections"])  # same CLIP weights
    assert with_t5.size_multiple == 16  # VAE 8x, patch 2


def test_flux_packs_latents_with_position_ids():
    latents = torch.randn(2, 16, 6, 10)
    packed = pack(latents)
    assert packed.shape == (2, 15, 64)
    assert torch.equal(unpack(packed, 6, 10), latents)
    assert torch.equal(packed[0, 1], latents[0, :, 0:2, 2:4].reshape(-1))  # token 1: the patch at row 0, col 1
    ids = image_ids(6, 10)
    assert ids.shape == (15, 3) and ids[6].tolist() == [0.0, 1.0, 1.0] and not ids[:, 0].any()

    fam = family("tiny-flux")
    d = start(fam, size=SIZE, height=2 * SIZE)
    assert d.latents.shape == (1, (2 * SIZE // 16) * (SIZE // 16), 64)
    assert fam.vae_input(d).shape == (1, 16, 2 * SIZE // 8, SIZE // 8)
    inputs = fam.denoiser_inputs([d])
    assert "guidance" not in inputs  # schnell has no guidance embedding
    assert torch.equal(inputs["img_ids"], image_ids(2 * SIZE // 8, SIZE // 8))
    assert inputs["txt_ids"].shape == (fam.text_length, 3) and not inputs["txt_ids"].any()
    assert torch.allclose(inputs["timestep"], d.timestep.float() / 1000)


def test_flux_guidance_is_an_embedding_per_image_never_an_unconditional_row():
    schnell, dev = family("tiny-flux"), family("tiny-flux-dev")
    assert not schnell.cfg_for(7.0) and not dev.cfg_for(7.0)
    a, b = start(dev, guidance=3.5), start(dev, "a boat", guidance=6.0)
    inputs = dev.denoiser_inputs([a, b])
    assert inputs["sample"].shape[0] == 2
    assert inputs["guidance"].tolist() == [3.5, 6.0]
    assert dev.defaults.guidance["relax"] == 3.5 and schnell.defaults.steps["turbo"] <= 4


def test_flow_schedules_follow_the_config():
    dev, schnell, sd3 = family("tiny-flux-dev"), family("tiny-flux"), family("tiny-sd3")
    # dev shifts with the image's token count (use_dynamic_shifting); schnell's schedule is fixed
    assert not torch.equal(
        dev.make_scheduler("euler", 4, 64, 64).sigmas, dev.make_scheduler("euler", 4, 256, 256).sigmas
    )
    assert torch.equal(
        schnell.make_scheduler("euler", 4, 64, 64).sigmas, schnell.make_scheduler("euler", 4, 256, 256).sigmas
    )
    sigmas = schnell.make_scheduler("euler", 4, 64, 64).sigmas
    torch.testing.assert_close(sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))  # shift 1, FluxPipeline's linspace
    # SD3: timesteps evenly spaced, then shifted (shift 3) toward high noise: 0.5 -> 0.75
    sd3_sigmas = sd3.make_scheduler("euler", 3, 64, 64).sigmas
    assert sd3_sigmas[0] == 1.0 and abs(sd3_sigmas[1] - 0.75) < 2e-3


@pytest.mark.parametrize("name,wrong", [("tiny-sd3", "dpmpp_2m"), ("tiny-flux", "euler_a"), ("tiny-sdxl", "heun")])
def test_samplers_a_family_cannot_use_are_refused(name, wrong):
    fam = family(name)
    with pytest.raises(FamilyError, match=f"sampler '{wrong}' does not apply to {fam.name} models"):
        start(fam, sampler=wrong)


@pytest.mark.parametrize("name", ["tiny-sdxl", "tiny-sd3", "tiny-flux"])
def test_sizes_off_the_grid_are_refused(name):
    fam = family(name)
    bad = fam.size_multiple * 4 + 8
    with pytest.raises(FamilyError, match=f"not a multiple of {fam.size_multiple}"):
        start(fam, size=bad)


def test_noise_is_drawn_on_the_cpu_from_the_seed():
    fam = family("tiny-sdxl")
    d = start(fam, seed=42, guidance=0.0, sampler="euler")
    want = torch.randn((1, 4, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(42))
    torch.testing.assert_close(d.latents, want * d.scheduler.init_noise_sigma)
    assert d.generator.device.type == "cpu"
