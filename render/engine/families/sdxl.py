"""SDXL: two CLIP encoders side by side, and a UNet that adds the pooled embedding and size "time ids".

As StableDiffusionXLPipeline: each encoder's penultimate hidden states, concatenated; the
second (with projection) gives the pooled `text_embeds`; `time_ids` are (original size,
crop top-left, target size) = (h, w, 0, 0, h, w) per image. With force_zeros_for_empty_prompt
(the SDXL default) an empty prompt - the worker's default negative prompt - conditions on
zeros rather than on the encoding of "".
"""

from __future__ import annotations

import torch

from .base import EHS, TEXT_EMBEDS, TIME_IDS, Conditioning, Denoising, TierDefaults, module_device, tokens
from .sd import StableDiffusion


class StableDiffusionXL(StableDiffusion):
    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"
    components = ("unet", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    conditioning_inputs = (EHS, TEXT_EMBEDS)
    denoiser_added = (TEXT_EMBEDS, TIME_IDS)

    @property
    def defaults(self) -> TierDefaults:
        # turbo as SDXL-Turbo is sampled (1-4 steps, no guidance); SDXL base wants ~25-30 at 5-7.
        return TierDefaults.table(
            steps=(4, 20, 25, 30),
            guidance=(0.0, 6.0, 6.0, 6.0),
            sampler=("euler_a", "dpmpp_2m", "dpmpp_2m", "dpmpp_2m"),
        )

    def vae_needs_fp32(self, dtype: torch.dtype) -> bool:
        # StableDiffusionXLPipeline upcasts an fp16 VAE whose config says force_upcast (the original SDXL VAE)
        return dtype == torch.float16 and bool(self.vae.config.force_upcast)

    @property
    def force_zeros_for_empty_prompt(self) -> bool:
        return bool(self.parts.pipeline_config.get("force_zeros_for_empty_prompt", True))

    @torch.inference_mode()
    def encode_prompts(self, prompts: list[str]) -> list[Conditioning]:
        hidden, pooled = [], None
        for enc_name, tok_name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
            encoder, tokenizer = self.module(enc_name), self.module(tok_name)
            ids = tokens(tokenizer, prompts, tokenizer.model_max_length)
            out = encoder(ids.to(module_device(encoder)), output_hidden_states=True)
            if out[0].ndim == 2:  # the projection encoder's text_embeds: the pooled embedding
                pooled = out[0]
            hidden.append(out.hidden_states[-2])
        assert pooled is not None, "text_encoder_2 must be a CLIPTextModelWithProjection"
        conds: list[Conditioning] = []
        for prompt, h, p in zip(prompts, torch.cat(hidden, dim=-1), pooled, strict=True):
            if prompt == "" and self.force_zeros_for_empty_prompt:
                h, p = torch.zeros_like(h), torch.zeros_like(p)
            conds.append({EHS: h, TEXT_EMBEDS: p})
        return conds

    @property
    def extra_input_names(self) -> tuple[str, ...]:
        return (TIME_IDS,)

    def extra_inputs(self, owners: list[Denoising]) -> dict[str, torch.Tensor]:
        # original size, crop top-left, target size: the pipeline's defaults for a plain text-to-image call
        return {
            TIME_IDS: torch.tensor([[d.height, d.width, 0, 0, d.height, d.width] for d in owners], dtype=torch.float32)
        }

    def row_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        cfg = self.denoiser.config  # the UNet's added embedding takes the pooled vector and six time ids
        pooled = int(cfg.projection_class_embeddings_input_dim) - 6 * int(cfg.addition_time_embed_dim)
        return {**super().row_shapes(height, width), TEXT_EMBEDS: (pooled,), TIME_IDS: (6,)}

    def pipeline_call_kwargs(self) -> dict:
        return {"negative_prompt": None}  # the pipeline's zeros for no negative prompt: the family's ""

    def pipeline_kwargs(self) -> dict:
        return {
            "image_encoder": None,
            "feature_extractor": None,
            "add_watermarker": False,
            "force_zeros_for_empty_prompt": self.force_zeros_for_empty_prompt,
        }
