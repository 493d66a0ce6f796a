"""Engine cache: the key covers everything an engine depends on; bad entries are rebuilt.

The builder here is a stand-in (TensorRT cannot exist without a GPU): the cache only sees
bytes in and an engine object out, so the rebuild path is exercised for real on disk.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from render.engine.backends.engine_cache import EngineCache, EngineKey
from turbonode.errors import BackendUnavailable

BASE = EngineKey(
    component="denoiser",
    family="sdxl",
    model_hash="tiny-0123456789abcdef",
    trt_version="11.4.0.106",
    gpu_name="NVIDIA H200",
    compute_capability=(9, 0),
    min_batch=1,
    max_batch=8,
    resolutions=((512, 512),),
    precision="fp16",
)

CHANGES = {
    "component": "decoder",
    "family": "flux",
    "model_hash": "tiny-fedcba9876543210",
    "trt_version": "10.13.3.9",
    "gpu_name": "NVIDIA A100-SXM4-80GB",
    "compute_capability": (8, 0),
    "min_batch": 2,
    "max_batch": 4,
    "resolutions": ((512, 512), (768, 768)),
    "precision": "fp32",
}


def test_every_field_is_covered_by_a_change_case():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(EngineKey)}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_key_changes_when_any_part_changes(field):
    other = dataclasses.replace(BASE, **{field: CHANGES[field]})
    assert other.digest() != BASE.digest()
    assert other.filename() != BASE.filename()


def test_key_is_stable_and_ignores_resolution_order_and_duplicates():
    a = dataclasses.replace(BASE, resolutions=((768, 512), (512, 512), (768, 512)))
    b = dataclasses.replace(BASE, resolutions=[[512, 512], [768, 512]], compute_capability=[9, 0])
    assert a.digest() == b.digest()
    assert BASE.digest() == dataclasses.replace(BASE).digest()
    assert BASE.filename().startswith("sdxl-denoiser-fp16-") and BASE.filename().endswith(".engine")


@pytest.mark.parametrize("bad", [{"min_batch": 0}, {"min_batch": 5, "max_batch": 4}, {"resolutions": ()}])
def test_key_rejects_impossible_profiles(bad):
    with pytest.raises(ValueError):
        dataclasses.replace(BASE, **bad)


class FakeEngine:
    def __init__(self, blob: bytes):
        self.blob = blob


def deserialize(blob: bytes):
    """Like TensorRT's runtime: None for bytes that are not a plan of ours."""
    return FakeEngine(blob) if blob.startswith(b"PLAN:") else None


class Builder:
    def __init__(self, blob=b"PLAN:unet"):
        self.blob, self.calls = blob, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.blob


def test_miss_builds_stores_and_then_hits(tmp_path, caplog):
    cache, build = EngineCache(tmp_path / "engines"), Builder()
    with caplog.at_level(logging.INFO, logger="render.engine.backends.engine_cache"):
        engine = cache.load_or_build(BASE, build, deserialize)
    assert engine.blob == b"PLAN:unet" and build.calls == 1
    path = cache.path_for(BASE)
    assert path.read_bytes() == b"PLAN:unet"
    assert '"gpu_name":"NVIDIA H200"' in path.with_suffix(".json").read_text()
    assert any("built the sdxl denoiser engine in" in r.message for r in caplog.records)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    again = cache.load_or_build(BASE, build, deserialize)
    assert again.blob == b"PLAN:unet" and build.calls == 1


def test_different_key_gets_its_own_engine(tmp_path):
    cache, build = EngineCache(tmp_path), Builder()
    cache.load_or_build(BASE, build, deserialize)
    cache.load_or_build(dataclasses.replace(BASE, max_batch=4), build, deserialize)
    assert build.calls == 2 and len(list(tmp_path.glob("*.engine"))) == 2


@pytest.mark.parametrize("damage", [b"", b"PL", b"garbage from another TensorRT"])
def test_corrupt_engine_is_rebuilt_not_fatal(tmp_path, caplog, damage):
    cache, build = EngineCache(tmp_path), Builder()
    cache.load_or_build(BASE, build, deserialize)
    cache.path_for(BASE).write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="render.engine.backends.engine_cache"):
        engine = cache.load_or_build(BASE, build, deserialize)
    assert engine.blob == b"PLAN:unet" and build.calls == 2
    assert cache.path_for(BASE).read_bytes() == b"PLAN:unet"
    assert any("rebuilding" in r.message for r in caplog.records)


def test_deserializer_that_raises_is_treated_as_corrupt(tmp_path):
    cache, build = EngineCache(tmp_path), Builder()
    cache.load_or_build(BASE, build, deserialize)

    calls = []

    def picky(blob):
        calls.append(blob)
        if len(calls) == 1:
            raise RuntimeError("engine plan file is incompatible with this version")
        return FakeEngine(blob)

    assert cache.load_or_build(BASE, build, picky).blob == b"PLAN:unet"
    assert build.calls == 2


def test_failed_build_is_a_clear_error_and_leaves_nothing(tmp_path):
    cache = EngineCache(tmp_path)
    with pytest.raises(BackendUnavailable, match="could not build the sdxl denoiser engine"):
        cache.load_or_build(BASE, Builder(b""), deserialize)
    with pytest.raises(BackendUnavailable, match="does not deserialize"):
        cache.load_or_build(BASE, Builder(b"not a plan"), deserialize)
    assert list(tmp_path.iterdir()) == []


def test_builder_exception_propagates_and_leaves_nothing(tmp_path):
    def explode():
        raise BackendUnavailable("TensorRT cannot parse unet.onnx")

    with pytest.raises(BackendUnavailable, match="cannot parse"):
        EngineCache(tmp_path).load_or_build(BASE, explode, deserialize)
    assert not list(tmp_path.glob("*.engine"))
