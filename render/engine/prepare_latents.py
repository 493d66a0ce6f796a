"""Stage 2, prepare latents: a sample's own scheduler and its seeded initial noise (diffusers'
`prepare_latents`), at the sample's first step, so the throttle's step cap in force then applies.

The model family does it (render/engine/families/base.py `Family.start`): a scheduler built
`from_config` from the model's scheduler config for this sampler, steps and size, never shared
with another job, and noise from the sample's own generator (job seed + image index), drawn on
the CPU so a seed gives the same image on any device, in the family's latent layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families.base import Family
from .job import Sample


@dataclass(frozen=True)
class LatentPreparer:
    family: Family
    device: torch.device

    def __call__(self, sample: Sample, sampler: str, steps: int) -> None:
        """Give `sample` its denoising state: scheduler (`steps` timesteps), generator, initial latents."""
        job, req = sample.job, sample.job.request
        assert job.cond is not None, "a job is encoded before its samples start"
        sample.state = self.family.start(
            cond=job.cond,
            uncond=job.uncond,
            guidance=req.guidance,
            seed=sample.seed,
            height=req.height,
            width=req.width,
            sampler=sampler,
            steps=steps,
            device=self.device,
        )
