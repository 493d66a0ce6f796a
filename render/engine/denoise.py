"""Stage 3, denoise: one step for a batch of samples (diffusers' denoising loop body).

The samples may come from different jobs, tiers, prompts and timesteps: the model family
turns them into one batch of named tensors (latents, a timestep per row, every row's
conditioning: SDXL's pooled embeddings and time ids, SD3/Flux pooled projections, Flux's
position ids and guidance), the backend evaluates the denoiser once on it, and each sample's
own scheduler then steps its slice. With classifier-free guidance (where the family uses it)
a sample is two rows (unconditional, conditional) combined with its job's guidance scale.
"""

from __future__ import annotations

from collections.abc import Sequence

from .backends.base import DiffusionBackend
from .families.base import Family
from .job import Sample


def rows(family: Family, sample: Sample) -> int:
    """Denoiser rows a sample takes: 2 with classifier-free guidance."""
    return 2 if family.cfg_for(sample.job.request.guidance) else 1


def denoise_step(family: Family, backend: DiffusionBackend, samples: Sequence[Sample]) -> int:
    """Advance every (prepared) sample by one step; returns the denoiser rows evaluated."""
    states = [s.state for s in samples if s.state is not None]
    assert len(states) == len(samples), "samples are prepared before their first step"
    return family.step(states, backend.predict)
