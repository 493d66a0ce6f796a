"""Every family, rendered standalone with its tiny variant: determinism, batching, parity with diffusers.

The step loop is the family's (render/engine/families): per-image schedulers and noise, one batched
denoiser call per step for images of any prompt, steps, progress and guidance. Its images must
equal what diffusers' own pipeline (StableDiffusion(XL|3)Pipeline, FluxPipeline) renders from
the same modules, seed and scheduler.
"""

from __future__ import annotations

import pytest
import torch

from tests.render.helpers import NAMES, SIZE, family, guidance_for, image, predictor, run, start

ALL = (*NAMES, "tiny-sd3-no-t5", "tiny-flux-dev")
BATCH_ATOL = 1e-4  # batched vs alone: same arithmetic, different GEMM blocking


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_image_and_prompts_matter(name):
    fam = family(name)
    a, b, other_seed, other_prompt = (
        start(fam, seed=7),
        start(fam, seed=7),
        start(fam, seed=8),
        start(fam, "a blue dog", seed=7),
    )
    for d in (a, b, other_seed, other_prompt):
        run(fam, [d])
    assert torch.equal(image(fam, a), image(fam, b))
    assert (image(fam, a) - image(fam, other_seed)).abs().max() > 1e-2
    # the prompt reaches the image through every conditioning input (random weights: a small effect)
    assert (image(fam, a) - image(fam, other_prompt)).abs().max() > 1e-4
    assert image(fam, a).shape == (3, SIZE, SIZE)


@pytest.mark.parametrize("name", ALL)
def test_an_image_is_the_same_alone_or_batched_with_others(name):
    """Batched with images of other prompts, steps, progress and guidance: one call per step, same result."""
    fam = family(name)
    alone = start(fam, "a red cat", seed=3, steps=4)
    run(fam, [alone])

    mine = start(fam, "a red cat", seed=3, steps=4)
    ahead = start(fam, "a green tree", seed=4, steps=6, guidance=guidance_for(fam) * 1.5)
    other = start(fam, "a small boat", seed=5, steps=3, guidance=0.0)
    predict = predictor(fam)
    for _ in range(2):  # `ahead` takes two steps of its own first: a different progress in the shared batch
        fam.step([ahead], predict)
    calls = run(fam, [mine, ahead, other])
    assert calls == 4  # every step of `mine` was one denoiser call shared with the others
    assert [d.step for d in (mine, ahead, other)] == [4, 6, 3]
    torch.testing.assert_close(mine.latents, alone.latents, atol=BATCH_ATOL, rtol=0)
    torch.testing.assert_close(image(fam, mine), image(fam, alone), atol=BATCH_ATOL, rtol=0)


@pytest.mark.parametrize(
    "name,sampler",
    [
        ("tiny", "dpmpp_2m"),
        ("tiny", "euler_a"),
        ("tiny-sdxl", "euler_a"),
        ("tiny-sdxl", "dpmpp_2m"),
        ("tiny-sd3", "euler"),
        ("tiny-sd3-no-t5", "euler"),
        ("tiny-flux", "euler"),
        ("tiny-flux-dev", "euler"),
    ],
)
def test_the_step_loop_reproduces_the_diffusers_pipeline(name, sampler):
    fam = family(name)
    guidance, steps, seed = guidance_for(fam), 3, 11
    mine = start(
        fam, "a painting of a lighthouse", seed=seed, steps=steps, guidance=guidance, sampler=sampler, height=SIZE * 2
    )  # not square: height and width must not be swapped anywhere
    run(fam, [mine])
    pipe = fam.pipeline(fam.make_scheduler(sampler, steps, SIZE * 2, SIZE))
    want = pipe(
        prompt="a painting of a lighthouse",
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=SIZE * 2,
        width=SIZE,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        **fam.pipeline_call_kwargs(),
    ).images[0]
    got = image(fam, mine)
    assert got.shape == want.shape == (3, SIZE * 2, SIZE)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"{name}/{sampler}: max abs diff {diff} vs diffusers"
    assert want.std() > 0.01  # not a blank image: the comparison means something


@pytest.mark.parametrize("name", NAMES)
def test_defaults_and_sizes(name):
    fam = family(name)
    assert (
        set(fam.defaults.steps)
        == set(fam.defaults.guidance)
        == set(fam.defaults.sampler)
        == {"turbo", "fast", "other", "relax"}
    )
    for tier, sampler in fam.defaults.sampler.items():
        fam.check_sampler(sampler)
        assert 1 <= fam.defaults.steps[tier] <= 50
    assert fam.defaults.steps["turbo"] <= 4 or fam.name == "flux" and fam.guidance_distilled
    assert not fam.cfg_for(fam.defaults.guidance["turbo"])  # turbo never pays for an unconditional row
    assert fam.native_size == 256 and fam.native_size % fam.size_multiple == 0
