"""FLUX.1: CLIP (pooled) + T5 (sequence), a transformer over 2x2-packed latent patches.

As FluxPipeline: the latents [C, h, w] are packed into a sequence of (h/2)(w/2) tokens of
4C channels, with image position ids (0, row, col) per token and zero ids per text token;
the transformer takes the timestep divided by 1000. Schnell (the turbo model: 1-4 steps) has
no guidance input and a fixed shift; dev is guidance-distilled: the guidance scale goes in as
an embedding per image (no unconditional row, ever) and the schedule shifts with the image's
token count. Decoding unpacks, then un-scales and un-shifts the latents.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from .base import (
    EHS,
    FLOW_SAMPLERS,
    GUIDANCE,
    IMG_IDS,
    LATENT_INPUT,
    POOLED,
    TIMESTEP_INPUT,
    TXT_IDS,
    Conditioning,
    Denoising,
    Family,
    TierDefaults,
    flow_match_scheduler,
    module_device,
    tokens,
)

T5_LENGTH = {False: 256, True: 512}  # FluxPipeline's max_sequence_length: schnell allows 256, dev 512


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: each 2x2 patch becomes one token."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack` for latent height h and width w."""
    b, _, c4 = latents.shape
    x = latents.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


@functools.lru_cache(maxsize=16)
def image_ids(h: int, w: int) -> torch.Tensor:
    """(0, row, col) for each packed token of an h x w latent (cached: every step of a size needs the same)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


class Flux(Family):
    name = "flux"
    pipeline_class = "FluxPipeline"
    denoiser_name = "transformer"
    denoiser_class = "FluxTransformer2DModel"
    components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    optional_components = frozenset({"image_encoder", "feature_extractor"})
    conditioning_inputs = (EHS, POOLED)
    denoiser_rename: ClassVar[Mapping[str, str]] = {LATENT_INPUT: "hidden_states"}
    latent_axes: ClassVar[Mapping[int, str]] = {1: "image_len"}
    shared_axes: ClassVar[Mapping[str, Mapping[int, str]]] = {IMG_IDS: {0: "image_len"}, TXT_IDS: {0: "text_len"}}
    samplers = FLOW_SAMPLERS
    cuda_dtype = torch.bfloat16  # T5 and the MMDiT's activations overflow fp16
    uses_cfg = False
    timestep_divisor = 1000.0

    @property
    def guidance_distilled(self) -> bool:
        return bool(self.denoiser.config.guidance_embeds)

    @property
    def defaults(self) -> TierDefaults:
        if self.guidance_distilled:  # dev: ~28 steps at an embedded guidance of 3.5
            return TierDefaults.table(steps=(8, 20, 28, 28), guidance=(3.5,) * 4, sampler=("euler",) * 4)
        # schnell: distilled to 1-4 steps; guidance has no input to go to
        return TierDefaults.table(steps=(2, 4, 4, 4), guidance=(0.0,) * 4, sampler=("euler",) * 4)

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2  # the VAE's scale times the 2x2 packing

    @property
    def native_size(self) -> int:
        # FluxTransformer2DModel records no sample size; the VAE's is the pipeline's 1024 default
        return int(self.vae.config.sample_size)

    @property
    def text_length(self) -> int:
        return min(T5_LENGTH[self.guidance_distilled], int(self.module("tokenizer_2").model_max_length))

    @torch.inference_mode()
    def encode_prompts(self, prompts: list[str]) -> list[Conditioning]:
        clip, t5 = self.module("text_encoder"), self.module("text_encoder_2")
        clip_ids = tokens(self.module("tokenizer"), prompts, int(self.module("tokenizer").model_max_length))
        pooled = clip(clip_ids.to(module_device(clip)), output_hidden_states=False).pooler_output
        t5_ids = tokens(self.module("tokenizer_2"), prompts, self.text_length)
        states = t5(t5_ids.to(module_device(t5)), output_hidden_states=False)[0]
        return [{EHS: h, POOLED: p.to(h.device)} for h, p in zip(states, pooled, strict=True)]

    def pack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return pack(latents)

    def vae_input(self, d: Denoising) -> torch.Tensor:
        return unpack(d.latents, *self.latent_size(d.height, d.width))

    def image_seq_len(self, height: int, width: int) -> int:
        h, w = self.latent_size(height, width)
        return (h // 2) * (w // 2)

    def make_scheduler(self, sampler: str, steps: int, height: int, width: int) -> Any:
        self.check_sampler(sampler)
        sigmas = np.linspace(1.0, 1 / steps, steps).tolist()
        return flow_match_scheduler(
            self.scheduler_config, steps, sigmas=sigmas, image_seq_len=self.image_seq_len(height, width), max_shift=1.15
        )

    @property
    def extra_input_names(self) -> tuple[str, ...]:
        return (IMG_IDS, TXT_IDS, GUIDANCE) if self.guidance_distilled else (IMG_IDS, TXT_IDS)

    def extra_inputs(self, owners: list[Denoising]) -> dict[str, torch.Tensor]:
        # ids are per token, not per row: every image of a batch has the same size
        d = owners[0]
        out = {IMG_IDS: image_ids(*self.latent_size(d.height, d.width)), TXT_IDS: torch.zeros(self.text_length, 3)}
        if self.guidance_distilled:
            out[GUIDANCE] = torch.tensor([o.guidance for o in owners], dtype=torch.float32)
        return out

    def row_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        cfg = self.denoiser.config
        shapes = {
            LATENT_INPUT: (self.image_seq_len(height, width), cfg.in_channels),
            TIMESTEP_INPUT: (),
            EHS: (self.text_length, cfg.joint_attention_dim),
            POOLED: (cfg.pooled_projection_dim,),
        }
        return {**shapes, GUIDANCE: ()} if self.guidance_distilled else shapes

    def shared_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        return {IMG_IDS: (self.image_seq_len(height, width), 3), TXT_IDS: (self.text_length, 3)}

    def pipeline_call_kwargs(self) -> dict:
        return {"max_sequence_length": self.text_length}

    def pipeline_kwargs(self) -> dict:
        return {"image_encoder": None, "feature_extractor": None}
