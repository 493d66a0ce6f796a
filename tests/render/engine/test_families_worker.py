"""The worker with a model of each family behind it: engine, cache, control status, HTTP API.

Per family (the tiny SD 1.x, SDXL, SD3, Flux-schnell variants, and a guidance-distilled
Flux-dev): the same seed gives the same image through the engine; a job's image is the same
whether it ran alone or batched with jobs of other tiers, prompts, steps and progress (one
denoiser call per step for all of them); the text-embedding cache holds every encoder's
output; `status` and GET /v1/models name what is served; the official `openai` client gets
an image.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from render.front.control_server import ControlHandlers
from render.gc_telemetry import GcMonitor
from tests.render.helpers import SIZE, drain, family, guidance_for, make_engine, req, serve

FAMILIES = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-flux-dev")


def _req(name, tier, **kw):
    kw.setdefault("guidance", guidance_for(family(name)) if tier != "turbo" else 0.0)
    return req(tier, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_same_seed_same_image_through_the_engine(name):
    engine = make_engine(model=name, max_batch=4)
    jobs = [engine.submit(_req(name, "fast", seed=s, steps=2)) for s in (5, 5, 6)]
    drain(engine, jobs)
    a, b, c = (j.samples[0].image.astype(int) for j in jobs)
    assert a.shape == (SIZE, SIZE, 3)
    assert np.abs(a - b).max() <= 1  # same seed; rows at other batch positions: float tolerance
    assert np.abs(a - c).max() > 10


@pytest.mark.parametrize("name", FAMILIES)
def test_a_job_renders_the_same_alone_or_batched_with_other_tiers_steps_and_progress(name):
    alone_engine = make_engine(model=name, max_batch=1)
    alone = alone_engine.submit(_req(name, "fast", prompt="a red cat", seed=3, steps=3))
    drain(alone_engine, [alone])

    events = []
    engine = make_engine(model=name, max_batch=6, on_event=events.append)
    ahead = engine.submit(_req(name, "relax", prompt="a green tree", seed=4, steps=5))
    engine.run_once()  # admit and take a step: `ahead` is one step further than the others
    engine.run_once()
    mine = engine.submit(_req(name, "fast", prompt="a red cat", seed=3, steps=3))
    other = engine.submit(_req(name, "other", prompt="a small boat", seed=5, steps=4, guidance=0.0))
    drain(engine, [ahead, mine, other])
    mine_steps = [e for e in events if e["kind"] == "step" and any(s[0] == mine.id for s in e["samples"])]
    assert len(mine_steps) == 3  # one denoiser call per step of `mine` ...
    shared = [{s[1] for s in e["samples"]} for e in mine_steps]
    assert all(tiers >= {"fast", "relax", "other"} for tiers in shared)  # ... shared with both other jobs
    got, want = mine.samples[0].image.astype(int), alone.samples[0].image.astype(int)
    assert np.abs(got - want).max() <= 1  # float tolerance: one 8-bit level


@pytest.mark.parametrize("name", ["tiny-sdxl", "tiny-sd3", "tiny-flux"])
def test_the_text_cache_holds_every_encoders_output(name):
    engine = make_engine(model=name, max_batch=2)
    first = engine.submit(_req(name, "fast", prompt="a cached prompt", seed=1, steps=1))
    drain(engine, [first])
    misses = engine.encoder.misses
    entry = engine.encoder._lookup("a cached prompt")
    assert entry is not None and set(entry) == set(family(name).conditioning_inputs)  # pooled too
    assert len(set(entry)) == 2
    again = engine.submit(_req(name, "fast", prompt="a cached prompt", seed=1, steps=1))
    drain(engine, [again])
    assert engine.encoder.misses == misses  # every encoder's output came from the cache
    assert np.array_equal(again.samples[0].image, first.samples[0].image)


@pytest.mark.parametrize("name", ["tiny-sdxl", "tiny-flux"])
def test_status_names_the_model_and_its_family(name):
    engine = make_engine(model=name)
    st = ControlHandlers(engine, GcMonitor()).status()
    fam = family(name)
    assert st["model"]["model"] == name and st["model"]["family"] == fam.name
    assert st["model"]["pipeline"] == fam.pipeline_class
    assert st["model"]["defaults"]["steps"] == dict(fam.defaults.steps)
    assert st["model"]["defaults"]["sampler"]["turbo"] == fam.defaults.sampler["turbo"]


def _png(b64):
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_official_openai_client_gets_an_image_and_the_model_list(name):
    from openai import OpenAI

    with serve(model=name, max_batch=4) as server:
        with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            result = client.images.generate(
                prompt="a lighthouse at dusk",
                n=2,
                size=f"{SIZE}x{SIZE}",
                response_format="b64_json",
                extra_body={"tier": "turbo", "steps": 2, "seed": 11},
            )
            models = client.models.list()
            model = client.models.retrieve(name)
    images = [_png(d.b64_json) for d in result.data]
    assert [i.shape for i in images] == [(SIZE, SIZE, 3)] * 2 and not np.array_equal(images[0], images[1])
    assert [m.id for m in models.data] == [name] and model.id == name and model.owned_by == "turbonode"
    info = models.data[0].model_extra["turbonode"]
    assert info["family"] == family(name).name and info["defaults"]["steps"]["turbo"] <= 8
    assert info["backend"]["name"] == "torch" and info["backend"]["execution"] == "graph"
    assert info["backend"]["graphs"] == 2  # the denoiser and the VAE, traced at start for SIZE


def test_an_unknown_model_id_is_a_404():
    with serve(model="tiny-flux") as server:
        try:
            urllib.request.urlopen(server.url + "/v1/models/dall-e-3", timeout=30)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
            assert exc.code == 404 and "this worker serves 'tiny-flux'" in body["error"]["message"]
        else:
            raise AssertionError("expected 404")
