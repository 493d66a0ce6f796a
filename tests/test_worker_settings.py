"""The worker's configuration keys and how the engine reads them."""

from __future__ import annotations

import pytest

from render.engine import EngineSettings
from render.samplers import SAMPLERS, make_scheduler
from render.tiny import SCHEDULER_CONFIG
from turbonode.config import SAMPLER_NAMES, load_config


def test_sampler_names_match_the_config_contract():
    assert tuple(SAMPLERS) == SAMPLER_NAMES


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
    assert settings.steps == {"turbo": 2, "fast": 12, "other": 20, "relax": 25}
    assert settings.sampler["relax"] == "ddim" and settings.sampler["turbo"] == "euler_a"
    assert settings.guidance["fast"] == 3 and settings.guidance["turbo"] == 0.0
    assert settings.max_batch == 8 and settings.min_share == 0.2
