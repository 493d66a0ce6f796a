"""Stage 4, decode: finished latents through the VAE to 8-bit RGB images (diffusers' `decode`
plus its image post-processing). The family first undoes its latent layout (Flux unpacks);
the backend's decoder applies the VAE's scaling and shift."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .backends.base import DiffusionBackend
from .families.base import Family
from .job import Sample


def decode_images(family: Family, backend: DiffusionBackend, samples: Sequence[Sample]) -> list[np.ndarray]:
    """One VAE call for the batch; an HxWx3 uint8 array per sample, in order."""
    latents = [family.vae_input(s.state) for s in samples if s.state is not None]
    images = backend.decode(torch.cat(latents))
    pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return list(pixels.permute(0, 2, 3, 1).cpu().numpy())
