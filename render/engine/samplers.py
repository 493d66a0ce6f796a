"""Sampler names -> diffusers scheduler classes, one fresh scheduler per job.

Every job gets its own scheduler built with `from_config` from the model's scheduler
config, so multistep samplers (DPM-Solver keeps past model outputs) never share state
between jobs that happen to be batched together.
"""

from __future__ import annotations

import diffusers

# name -> (diffusers class, config overrides); the names are turbonode.config.SAMPLER_NAMES.
# Few-step samplers use 'trailing' spacing so the first step starts from pure noise (t=999),
# as SD-Turbo is trained for.
SAMPLERS: dict[str, tuple[str, dict]] = {
    "euler_a": ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"}),
    "euler": ("EulerDiscreteScheduler", {"timestep_spacing": "trailing"}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "lcm": ("LCMScheduler", {"timestep_spacing": "trailing"}),
}


def make_scheduler(name: str, scheduler_config: dict, steps: int):
    """A ready scheduler for one job: built from the model's config, timesteps set."""
    try:
        cls_name, overrides = SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r} (expected one of {', '.join(SAMPLERS)})") from None
    config = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    scheduler = getattr(diffusers, cls_name).from_config({**config, **overrides})
    scheduler.set_timesteps(steps)
    return scheduler
