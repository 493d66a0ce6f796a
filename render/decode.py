"""Stage 4, decode: finished latents through the VAE to 8-bit RGB images (diffusers' `decode`
plus its image post-processing)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .backends.base import DiffusionBackend
from .jobs import Sample


def decode_images(backend: DiffusionBackend, samples: Sequence[Sample]) -> list[np.ndarray]:
    """One VAE call for the batch; an HxWx3 uint8 array per sample, in order."""
    images = backend.decode(torch.cat([s.latents for s in samples]))
    pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return list(pixels.permute(0, 2, 3, 1).cpu().numpy())
