"""SDXL: two CLIP encoders side by side, and a UNet that adds the pooled embedding and size "time ids".

As StableDiffusionXLPipeline: each encoder's penultimate hidden states, concatenated; the
second (with projection) gives the pooled `text_embeds`; `time_ids` are (original size,
crop top-left, target size) = (h, w, 0, 0, h, w) per image. With force_zeros_for_empty_prompt
(the SDXL default) an empty prompt - the worker's default negative prompt - conditions on
zeros rather than on the encoding of "".
"""

from __future__ import annotations

import torch

from .base import Conditioning, Denoising, TierDefaults, module_device, tokens
from .sd import EHS, StableDiffusion

TEXT_EMBEDS, TIME_IDS = "text_embeds", "time_ids"


class SDXLUNet(torch.nn.Module):
    """The SDXL UNet as a function of plain tensors (what the ONNX graph and a TensorRT engine take)."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        text_embeds: torch.Tensor,
        time_ids: torch.Tensor,
    ) -> torch.Tensor:
        return self.unet(
            sample,
            timestep,
            encoder_hidden_states=encoder_hidden_states,
            added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids},
            return_dict=False,
        )[0]


class StableDiffusionXL(StableDiffusion):
    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"
    components = ("unet", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    conditioning_inputs = (EHS, TEXT_EMBEDS)

    @property
    def defaults(self) -> TierDefaults:
        # turbo as SDXL-Turbo is sampled (1-4 steps, no guidance); SDXL base wants ~25-30 at 5-7.
        return TierDefaults(
            steps={"turbo": 4, "fast": 20, "other": 25, "relax": 30},
            guidance={"turbo": 0.0, "fast": 6.0, "other": 6.0, "relax": 6.0},
            sampler={"turbo": "euler_a", "fast": "dpmpp_2m", "other": "dpmpp_2m", "relax": "dpmpp_2m"},
        )

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
        states = torch.cat(hidden, dim=-1)
        out_list: list[Conditioning] = []
        for prompt, h, p in zip(prompts, states, pooled):
            if prompt == "" and self.force_zeros_for_empty_prompt:
                h, p = torch.zeros_like(h), torch.zeros_like(p)
            out_list.append({EHS: h, TEXT_EMBEDS: p})
        return out_list

    @property
    def extra_input_names(self) -> tuple[str, ...]:
        return (TIME_IDS,)

    def extra_inputs(self, owners: list[Denoising]) -> dict[str, torch.Tensor]:
        # original size, crop top-left, target size: the pipeline's defaults for a plain text-to-image call
        return {
            TIME_IDS: torch.tensor([[d.height, d.width, 0, 0, d.height, d.width] for d in owners], dtype=torch.float32)
        }

    def denoiser_module(self) -> torch.nn.Module:
        return SDXLUNet(self.denoiser)

    def input_shapes(self, rows: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        pooled = self.module("text_encoder_2").config.projection_dim
        return {**super().input_shapes(rows, height, width), TEXT_EMBEDS: (rows, pooled), TIME_IDS: (rows, 6)}

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {**super().dynamic_axes(), TEXT_EMBEDS: {0: "batch"}, TIME_IDS: {0: "batch"}}

    def pipeline_kwargs(self) -> dict:
        return {
            "image_encoder": None,
            "feature_extractor": None,
            "add_watermarker": False,
            "force_zeros_for_empty_prompt": self.force_zeros_for_empty_prompt,
        }
