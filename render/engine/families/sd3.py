"""Stable Diffusion 3.x: two CLIP encoders plus an optional T5, and an MMDiT transformer.

As StableDiffusion3Pipeline: the CLIP encoders' penultimate hidden states side by side,
zero-padded to T5's width, then T5's sequence after them (zeros when the checkpoint ships
without T5, as the pipeline does); the pooled projection is both CLIP text_embeds side by
side. Flow matching: FlowMatchEulerDiscreteScheduler from the model's config, its shift
(resolution-dependent where the config asks for it); VAE latents carry a shift factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from .base import (
    EHS,
    FLOW_SAMPLERS,
    LATENT_INPUT,
    POOLED,
    TIMESTEP_INPUT,
    Conditioning,
    Family,
    TierDefaults,
    flow_match_scheduler,
    module_device,
    tokens,
)

T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length


class StableDiffusion3(Family):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    denoiser_name = "transformer"
    denoiser_class = "SD3Transformer2DModel"
    components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    optional_components = frozenset({"text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor"})
    conditioning_inputs = (EHS, POOLED)
    denoiser_rename: ClassVar[Mapping[str, str]] = {LATENT_INPUT: "hidden_states"}
    samplers = FLOW_SAMPLERS
    cuda_dtype = torch.bfloat16  # T5 and the MMDiT's activations overflow fp16

    @property
    def defaults(self) -> TierDefaults:
        # turbo as SD3.5-Large-Turbo is sampled (4 steps, no guidance); SD3 medium: 28 steps at 7.
        return TierDefaults.table(steps=(4, 16, 28, 28), guidance=(0.0, 5.0, 7.0, 7.0), sampler=("euler",) * 4)

    @property
    def patch_size(self) -> int:
        return int(self.denoiser.config.patch_size)

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * self.patch_size

    @property
    def native_size(self) -> int:
        return int(self.denoiser.config.sample_size) * self.vae_scale_factor

    @property
    def clip_length(self) -> int:
        return int(self.module("tokenizer").model_max_length)

    @property
    def t5_length(self) -> int:
        tokenizer = self.module("tokenizer_3")
        return T5_LENGTH if tokenizer is None else min(T5_LENGTH, int(tokenizer.model_max_length))

    @property
    def text_length(self) -> int:
        return self.clip_length + self.t5_length

    @torch.inference_mode()
    def encode_prompts(self, prompts: list[str]) -> list[Conditioning]:
        hidden, pooled = [], []
        for enc_name, tok_name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
            encoder = self.module(enc_name)
            ids = tokens(self.module(tok_name), prompts, self.clip_length)
            out = encoder(ids.to(module_device(encoder)), output_hidden_states=True)
            pooled.append(out[0])
            hidden.append(out.hidden_states[-2])
        clip = torch.cat(hidden, dim=-1)
        t5_dim = int(self.denoiser.config.joint_attention_dim)
        t5 = self.module("text_encoder_3")
        if t5 is None:
            t5_states = torch.zeros(len(prompts), self.t5_length, t5_dim, dtype=clip.dtype, device=clip.device)
        else:
            ids = tokens(self.module("tokenizer_3"), prompts, self.t5_length)
            t5_states = t5(ids.to(module_device(t5)))[0].to(clip.device)
        clip = torch.nn.functional.pad(clip, (0, t5_dim - clip.shape[-1]))
        states = torch.cat([clip, t5_states.to(clip.dtype)], dim=-2)
        return [{EHS: h, POOLED: p} for h, p in zip(states, torch.cat(pooled, dim=-1))]

    def image_seq_len(self, height: int, width: int) -> int:
        h, w = self.latent_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size)

    def make_scheduler(self, sampler: str, steps: int, height: int, width: int) -> Any:
        self.check_sampler(sampler)
        return flow_match_scheduler(
            self.scheduler_config, steps, image_seq_len=self.image_seq_len(height, width), max_shift=1.16
        )

    def row_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        cfg = self.denoiser.config
        return {
            LATENT_INPUT: (cfg.in_channels, *self.latent_size(height, width)),
            TIMESTEP_INPUT: (),
            EHS: (self.text_length, cfg.joint_attention_dim),
            POOLED: (cfg.pooled_projection_dim,),
        }

    def pipeline_call_kwargs(self) -> dict:
        return {"max_sequence_length": self.t5_length}

    def pipeline_kwargs(self) -> dict:
        return {"image_encoder": None, "feature_extractor": None}
