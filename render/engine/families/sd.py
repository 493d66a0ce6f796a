"""Stable Diffusion 1.x/2.x: one CLIP text encoder, a UNet conditioned on its hidden states only."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from render.engine.samplers import SAMPLERS, make_scheduler

from .base import EHS, LATENT_INPUT, TIMESTEP_INPUT, Conditioning, Family, TierDefaults, module_device, tokens


class StableDiffusion(Family):
    name = "sd"
    pipeline_class = "StableDiffusionPipeline"
    denoiser_name = "unet"
    denoiser_class = "UNet2DConditionModel"
    components: ClassVar[tuple[str, ...]] = ("unet", "vae", "text_encoder", "tokenizer")
    optional_components = frozenset({"safety_checker", "feature_extractor", "image_encoder"})
    conditioning_inputs: ClassVar[tuple[str, ...]] = (EHS,)
    samplers = tuple(SAMPLERS)

    @property
    def defaults(self) -> TierDefaults:
        # SD-Turbo-style few steps without guidance for turbo; full CFG sampling for the rest.
        return TierDefaults.table(
            steps=(4, 12, 20, 25),
            guidance=(0.0, 7.5, 7.5, 7.5),
            sampler=("euler_a", "dpmpp_2m", "dpmpp_2m", "dpmpp_2m"),
        )

    @property
    def size_multiple(self) -> int:
        # the UNet halves the latent once per block after the first; sides must survive without remainders
        return self.vae_scale_factor * 2 ** (len(self.denoiser.config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        return int(self.denoiser.config.sample_size) * self.vae_scale_factor

    @property
    def text_length(self) -> int:
        return int(self.module("tokenizer").model_max_length)

    @torch.inference_mode()
    def encode_prompts(self, prompts: list[str]) -> list[Conditioning]:
        encoder = self.module("text_encoder")
        ids = tokens(self.module("tokenizer"), prompts, self.text_length)
        hidden = encoder(ids.to(module_device(encoder)), return_dict=False)[0]
        return [{EHS: h} for h in hidden]

    def make_scheduler(self, sampler: str, steps: int, height: int, width: int) -> Any:
        self.check_sampler(sampler)
        return make_scheduler(sampler, self.scheduler_config, steps)

    def row_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        cfg = self.denoiser.config
        return {
            LATENT_INPUT: (cfg.in_channels, *self.latent_size(height, width)),
            TIMESTEP_INPUT: (),
            EHS: (self.text_length, cfg.cross_attention_dim),
        }

    def pipeline_kwargs(self) -> dict:
        return {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
