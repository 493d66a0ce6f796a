"""The interface every denoiser/VAE backend implements.

The engine composes a batch of samples at each denoising step and calls the backend once:
one denoiser evaluation on the named tensors the model family built for the batch (latents,
a timestep per row, every row's conditioning: render/engine/families/base.py `denoiser_inputs`).
The text encoders stay in torch for every backend (they run once per prompt and are cached).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol

import torch

from .sizes import SizeRange


class DiffusionBackend(Protocol):
    """What the engine's stages call: the type of `Engine.backend` (a Backend, or a test's wrapper)."""

    device: torch.device
    dtype: torch.dtype

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> dict: ...


class Backend(ABC):
    """A model family's denoiser and VAE decoder on one device."""

    name: str = "abstract"
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def predict(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The family's denoiser inputs (one row each, per-row timesteps) -> a prediction shaped like the latents."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the scheduler left them [B,C,H,W] -> images [B,3,8H,8W] in [-1, 1]."""

    def sizes(self) -> SizeRange | None:
        """The image sizes this backend renders; None: any (the default). The HTTP API checks a
        request against them before queueing, so such a request is a 400, not a failed job."""
        return None

    def unsupported_size(self, height: int, width: int) -> str | None:
        """Why this backend cannot render height x width pixels, or None."""
        sizes = self.sizes()
        return None if sizes is None else sizes.unsupported(height, width)

    @abstractmethod
    def prepare(self, height: int, width: int) -> None:
        """Get ready for height x width images before the first request (what a first call would build)."""

    def describe(self) -> dict:
        """What `status` and the logs say about this backend (on a GPU, its NVML UUID: the agent
        watches that GPU for this worker whatever index the worker sees it under)."""
        uuid = gpu_uuid(self.device)
        return {
            "name": self.name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            **({"gpu_uuid": uuid} if uuid else {}),
        }


def gpu_uuid(device: torch.device) -> str | None:
    """A CUDA device's UUID as NVML and nvidia-smi write it ("GPU-<uuid>"); None off CUDA."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:  # an older torch
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
