"""The torch backend: the family's denoiser and VAE decoder as eager torch modules (CPU here, CUDA where present)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from render.families.base import FLOAT32_INPUTS, Family

from .base import Backend


def _place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    module = module.to(device)
    # diffusers logs a warning on every dtype cast, even a no-op one: cast only when needed.
    return module if next(module.parameters()).dtype == dtype else module.to(dtype)


class TorchBackend(Backend):
    """Runs the family's denoiser and VAE in torch: on CUDA in the family's half precision, fp32 on CPU.

    `decode` takes latents as the scheduler produced them and un-scales (and un-shifts) them
    itself, so callers never need to know the VAE's factors.
    """

    name = "torch"

    def __init__(self, family: Family, device: torch.device):
        self.device = torch.device(device)
        self.dtype = family.cuda_dtype if self.device.type == "cuda" else torch.float32
        self.denoiser = _place(family.denoiser_module(), self.device, self.dtype)
        self.input_names = family.input_names
        # SDXL's VAE overflows in fp16 (its config says force_upcast): it decodes in fp32, as diffusers does
        self.decoder_dtype = torch.float32 if family.vae_needs_fp32(self.dtype) else self.dtype
        self.decoder = _place(family.decoder_module(), self.device, self.decoder_dtype)

    @torch.inference_mode()
    def predict(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        args = [
            inputs[n].to(self.device, torch.float32 if n in FLOAT32_INPUTS else self.dtype) for n in self.input_names
        ]
        return self.denoiser(*args)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents.to(self.device, self.decoder_dtype))
