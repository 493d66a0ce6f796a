"""The interface every UNet/VAE backend implements.

The engine composes a batch of samples at each denoising step and calls the backend once:
one UNet evaluation with per-sample timesteps and text embeddings. The text encoder stays
in torch for every backend (it runs once per prompt and is cached).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch


class DiffusionBackend(Protocol):
    """What the engine's stages call: the type of `Engine.backend` (a Backend, or a test's wrapper)."""

    device: torch.device
    dtype: torch.dtype

    def predict_noise(
        self, latents: torch.Tensor, timesteps: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> dict: ...


class Backend(ABC):
    """A UNet noise predictor and VAE decoder on one device."""

    name: str = "abstract"
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def predict_noise(
        self, latents: torch.Tensor, timesteps: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """latents [B,C,H,W], timesteps [B] (one per sample), embeddings [B,L,D] -> noise [B,C,H,W]."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Unscaled latents [B,C,H,W] -> images [B,3,8H,8W] in [-1, 1]."""

    def unsupported_size(self, height: int, width: int) -> str | None:
        """Why this backend cannot render height x width pixels, or None (any size, by default).

        The HTTP API asks before queueing, so such a request is a 400, not a failed job.
        """
        return None

    def describe(self) -> dict:
        """What `status` and the logs say about this backend."""
        return {"name": self.name, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}
