"""Helpers for the model-family tests: one tiny model of each family per process, a step loop."""

from __future__ import annotations

import functools

import torch

from render.engine.families.base import Denoising, Family
from render.engine.model import load_model
from render.engine.tiny import variants as tiny

SIZE = 64  # pixels: a 8x8 latent keeps each denoiser call a few ms on CPU
# what each family's tests render: the SD 1.x tiny, the three new tiny variants, and the
# variants only tests build (SD3 shipped without T5, guidance-distilled Flux-dev)
NAMES = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux")
EXTRA = {"tiny-sd3-no-t5": lambda: tiny.sd3(t5=False), "tiny-flux-dev": lambda: tiny.flux(guidance_embeds=True)}


@functools.cache
def family(name: str) -> Family:
    torch.set_num_threads(2)
    if name in EXTRA:
        from render.engine.families import family_for

        parts = EXTRA[name]()
        return family_for(parts.pipeline_class)(parts)
    return load_model(name)


def guidance_for(fam: Family) -> float:
    """A guidance that exercises the family's conditioning: CFG where it has it, the embedding on Flux-dev."""
    if fam.uses_cfg:
        return 5.0
    return 3.5 if fam.name == "flux" and fam.guidance_distilled else 0.0  # type: ignore[attr-defined]


def start(
    fam: Family,
    prompt: str = "a red cat",
    *,
    seed: int = 1,
    steps: int = 3,
    guidance: float | None = None,
    negative: str = "",
    size: int = SIZE,
    sampler: str | None = None,
    height: int | None = None,
) -> Denoising:
    guidance = guidance_for(fam) if guidance is None else guidance
    cond, uncond = fam.encode_prompts([prompt, negative])
    return fam.start(
        cond=cond,
        uncond=uncond,
        guidance=guidance,
        seed=seed,
        height=height or size,
        width=size,
        sampler=sampler or fam.defaults.sampler["relax"],
        steps=steps,
    )


def predictor(fam: Family):
    module = fam.denoiser_module()

    @torch.inference_mode()
    def predict(inputs):
        return module.call(inputs)

    return predict


def run(fam: Family, batch: list[Denoising]) -> int:
    """Step every unfinished image of `batch` together, one denoiser call per step; returns the calls."""
    predict, calls = predictor(fam), 0
    while live := [d for d in batch if not d.done]:
        fam.step(live, predict)
        calls += 1
    return calls


@torch.inference_mode()
def image(fam: Family, d: Denoising) -> torch.Tensor:
    """The decoded image in [0, 1], [3, H, W] (what a pipeline's output_type='pt' gives)."""
    return (fam.decoder_module()(fam.vae_input(d))[0] / 2 + 0.5).clamp(0, 1)
