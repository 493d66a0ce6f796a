"""Stage 3, denoise: one step for a batch of samples (diffusers' denoising loop body).

The samples may come from different jobs, tiers and timesteps: one UNet evaluation through
the backend takes the whole batch with a timestep and text embeddings per row, and each
sample's own scheduler then steps its slice. With classifier-free guidance a sample is two
rows (unconditional, conditional) combined with its job's guidance scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends.base import DiffusionBackend
from .jobs import Sample


def rows(sample: Sample) -> int:
    """UNet rows a sample takes: 2 with classifier-free guidance."""
    return 2 if sample.job.request.cfg else 1


def denoise_step(backend: DiffusionBackend, samples: Sequence[Sample]) -> int:
    """Advance every (prepared) sample by one step; returns the UNet rows evaluated."""
    inputs, timesteps, embs, ts = [], [], [], []
    for s in samples:
        t = s.scheduler.timesteps[s.step]
        n = rows(s)
        x = torch.cat([s.latents] * n)
        inputs.append(s.scheduler.scale_model_input(x, t))
        timesteps.append(torch.full((n,), float(t)))
        embs.append(s.job.embeddings)
        ts.append(t)
    noise = backend.predict_noise(torch.cat(inputs), torch.cat(timesteps), torch.cat(embs)).float()
    offset = 0
    for s, t in zip(samples, ts):
        req = s.job.request
        eps = noise[offset : offset + rows(s)]
        offset += len(eps)
        if req.cfg:
            uncond, cond = eps.chunk(2)
            eps = uncond + req.guidance * (cond - uncond)
        s.latents = s.scheduler.step(eps, t, s.latents, generator=s.generator, return_dict=False)[0]
        s.step += 1
    return len(noise)
