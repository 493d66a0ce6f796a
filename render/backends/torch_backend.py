"""The torch backend: UNet and VAE as eager torch modules (CPU here, CUDA where present)."""

from __future__ import annotations

import torch

from .base import Backend


def _place(module, device, dtype):
    module = module.to(device)
    # diffusers logs a warning on every dtype cast, even a no-op one: cast only when needed.
    return module if module.dtype == dtype else module.to(dtype)


class TorchBackend(Backend):
    """Runs the diffusers UNet/VAE in torch; fp16 on CUDA, fp32 on CPU.

    `decode` takes latents as the scheduler produced them and divides by the VAE's
    scaling factor itself, so callers never need to know it.
    """

    name = "torch"

    def __init__(self, components, device: torch.device):
        self.device = torch.device(device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.unet = _place(components.unet, self.device, self.dtype)
        self.vae = _place(components.vae, self.device, self.dtype)
        self.scaling_factor = float(self.vae.config.scaling_factor)

    @torch.inference_mode()
    def predict_noise(self, latents, timesteps, encoder_hidden_states):
        return self.unet(
            latents.to(self.device, self.dtype),
            timesteps.to(self.device),
            encoder_hidden_states=encoder_hidden_states.to(self.device, self.dtype),
            return_dict=False,
        )[0]

    @torch.inference_mode()
    def decode(self, latents):
        latents = latents.to(self.device, self.dtype) / self.scaling_factor
        return self.vae.decode(latents, return_dict=False)[0]
