"""The worker's configuration keys and how the engine reads them."""

from __future__ import annotations

import dataclasses

import pytest

from render.engine.families.base import FamilyError
from render.engine.samplers import SAMPLERS, make_scheduler
from render.engine.scheduler import EngineSettings
from render.engine.tiny import BUILDERS
from render.engine.tiny.components import SCHEDULER_CONFIG
from tests.render.helpers import family
from turbonode.config import SAMPLER_NAMES, TINY_MODELS, load_config


def test_sampler_names_match_the_config_contract():
    assert tuple(SAMPLERS) == SAMPLER_NAMES


def test_tiny_model_names_match_the_config_contract():
    assert tuple(BUILDERS) == TINY_MODELS


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_every_sampler_builds_from_the_model_config(name):
    sched = make_scheduler(name, SCHEDULER_CONFIG, 4)
    assert len(sched.timesteps) == 4
    with pytest.raises(ValueError, match="unknown sampler"):
        make_scheduler("heun9", SCHEDULER_CONFIG, 4)


def test_partial_tier_tables_override_only_the_named_tiers(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(
        '[worker]\nsteps = { turbo = 2 }\nsampler = { relax = "ddim" }\nguidance = { fast = 3 }\n'
        "max_batch = 8\nmin_share = 0.2\n"
    )
    settings = EngineSettings.from_config(load_config(str(path), env={}).worker)
    assert (settings.steps, settings.sampler, settings.guidance) == ({"turbo": 2}, {"relax": "ddim"}, {"fast": 3})
    assert settings.max_batch == 8 and settings.min_share == 0.2
    # the tiers the file does not name take the model family's defaults (SD 1.x here)
    tiers = settings.tier_defaults(family("tiny"))
    assert tiers.steps == {"turbo": 2, "fast": 12, "other": 20, "relax": 25}
    assert tiers.sampler["relax"] == "ddim" and tiers.sampler["turbo"] == "euler_a"
    assert tiers.guidance["fast"] == 3 and tiers.guidance["turbo"] == 0.0
    # on Flux the same file's SD sampler is refused by its key; its steps and guidance apply
    with pytest.raises(FamilyError, match="worker.sampler.relax: sampler 'ddim' does not apply to flux models"):
        settings.tier_defaults(family("tiny-flux"))
    flux = dataclasses.replace(settings, sampler={}).tier_defaults(family("tiny-flux"))
    assert flux.steps == {"turbo": 2, "fast": 4, "other": 4, "relax": 4} and flux.sampler["relax"] == "euler"
