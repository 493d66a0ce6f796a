"""Stage 2, prepare latents: a sample's own scheduler and its seeded initial noise (diffusers'
`prepare_latents`), at the sample's first step, so the throttle's step cap in force then applies.

Each sample gets a scheduler built `from_config` from the model's scheduler config
(render/samplers.py), never shared with another job, and noise from its own generator
(job seed + image index), drawn on the CPU so a seed gives the same image on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .jobs import Sample
from .samplers import make_scheduler

LATENT_CHANNELS = 4  # the UNet's input channels in the SD 1.x/2.x family the worker serves


@dataclass(frozen=True)
class LatentPreparer:
    scheduler_config: dict[str, Any]
    vae_scale_factor: int
    device: torch.device

    def __call__(self, sample: Sample, sampler: str, steps: int) -> None:
        """Give `sample` its scheduler (`steps` timesteps), generator and initial latents."""
        req = sample.job.request
        sample.scheduler = make_scheduler(sampler, self.scheduler_config, steps)
        sample.total_steps = steps
        sample.generator = torch.Generator().manual_seed(sample.seed)
        shape = (1, LATENT_CHANNELS, req.height // self.vae_scale_factor, req.width // self.vae_scale_factor)
        noise = torch.randn(shape, generator=sample.generator, dtype=torch.float32)
        sample.latents = noise.to(self.device) * sample.scheduler.init_noise_sigma
