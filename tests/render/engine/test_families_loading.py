"""Loading models of every family: tiny names, diffusers directories saved from them, bad directories.

A directory saved with `save_pretrained` from each tiny variant must load back (local files
only) as the same family with the same weights; a partial or corrupt directory, or a pipeline
class this worker does not serve, is a ModelError that says what is wrong.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from render.engine.model import ModelError, load_model
from tests.helpers import ROOT
from tests.render.helpers import family

# float32 rounding of one forward pass: far under what a changed weight or tokenizer moves
ROUNDING = {"atol": 1e-5, "rtol": 1e-5}
SAVED = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-sd3-no-t5", "tiny-flux", "tiny-flux-dev")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each tiny variant saved as a diffusers directory, once per module."""
    out = {}
    for name in SAVED:
        fam = family(name)
        root = tmp_path_factory.mktemp(name)
        fam.pipeline(fam.make_scheduler(fam.defaults.sampler["relax"], 2, 64, 64)).save_pretrained(root)
        out[name] = root
    return out


def _copy(saved, name, tmp_path):
    root = tmp_path / name
    shutil.copytree(saved[name], root)
    return root


@pytest.mark.parametrize("name", SAVED)
def test_a_saved_directory_loads_back_as_the_same_family(saved, name):
    fam, loaded = family(name), load_model(str(saved[name]))
    assert type(loaded) is type(fam)
    assert loaded.model_id == str(saved[name].resolve())
    assert loaded.fingerprint == load_model(str(saved[name])).fingerprint != fam.fingerprint
    for built, back in [(fam.denoiser, loaded.denoiser), *zip(fam.text_encoders, loaded.text_encoders, strict=True)]:
        assert built.state_dict().keys() == back.state_dict().keys()
        for key, weight in built.state_dict().items():
            assert torch.equal(weight, back.state_dict()[key]), key
    # Same weights, same outputs up to float32 rounding: the BLAS kernels may round differently
    # for the same weights at another memory alignment (2.4e-7 seen on another VM). Another
    # prompt's outputs must lie outside the tolerance, or it could not see a real difference.
    want, got = fam.encode_prompts(["a red cat"])[0], loaded.encode_prompts(["a red cat"])[0]
    other = loaded.encode_prompts(["a blue dog"])[0]
    assert set(want) == set(got) == set(fam.conditioning_inputs)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **ROUNDING)
        assert not torch.allclose(other[key], want[key], **ROUNDING), key
    assert loaded.size_multiple == fam.size_multiple
    if name == "tiny-sd3-no-t5":
        assert loaded.module("text_encoder_3") is None


def test_tiny_names_and_unknown_models(tmp_path):
    for name in ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux"):
        assert load_model(name).model_id == name
    with pytest.raises(ModelError, match="neither one of tiny, tiny-sdxl, tiny-sd3, tiny-flux nor a directory"):
        load_model("stabilityai/sdxl-turbo")  # a hub id is never fetched
    with pytest.raises(ModelError, match="model_index.json is missing: not a diffusers model directory"):
        load_model(str(tmp_path))


def test_unsupported_pipelines_are_refused_by_name(saved, tmp_path):
    root = _copy(saved, "tiny-sdxl", tmp_path)
    index = json.loads((root / "model_index.json").read_text())
    for cls in ("StableDiffusionXLImg2ImgPipeline", "KandinskyV22Pipeline", None):
        (root / "model_index.json").write_text(json.dumps({**index, "_class_name": cls}))
        with pytest.raises(ModelError, match=f"{cls!r} pipelines are not served by this worker .*FluxPipeline"):
            load_model(str(root))


def test_partial_and_corrupt_directories_are_clear_errors(saved, tmp_path):
    root = _copy(saved, "tiny-flux", tmp_path)
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text())

    index_path.write_text("{not json")
    with pytest.raises(ModelError, match="model_index.json"):
        load_model(str(root))
    index_path.unlink()
    with pytest.raises(ModelError, match="model_index.json is missing"):
        load_model(str(root))

    index_path.write_text(json.dumps({k: v for k, v in index.items() if k != "text_encoder_2"}))
    with pytest.raises(ModelError, match="component 'text_encoder_2' is missing"):
        load_model(str(root))
    index_path.write_text(json.dumps({**index, "transformer": [None, None]}))
    with pytest.raises(ModelError, match="needs a transformer, and model_index.json has none"):
        load_model(str(root))
    index_path.write_text(json.dumps({**index, "transformer": ["diffusers", "SD3Transformer2DModel"]}))
    with pytest.raises(ModelError, match="FluxPipeline with a SD3Transformer2DModel transformer is not supported"):
        load_model(str(root))
    index_path.write_text(json.dumps({**index, "vae": ["my_package", "MyVAE"]}))
    with pytest.raises(ModelError, match="comes from 'my_package'.*no remote code"):
        load_model(str(root))
    index_path.write_text(json.dumps(index))

    weights = next((root / "transformer").glob("*.safetensors"))
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])  # an interrupted download
    with pytest.raises(ModelError, match=r"cannot load transformer \(FluxTransformer2DModel\)"):
        load_model(str(root))
    weights.write_bytes(blob)

    shutil.rmtree(root / "text_encoder_2")
    with pytest.raises(ModelError, match="the text_encoder_2/ folder is missing"):
        load_model(str(root))
    shutil.copytree(saved["tiny-flux"] / "text_encoder_2", root / "text_encoder_2")
    (root / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(ModelError, match="scheduler_config.json is missing"):
        load_model(str(root))


def test_loading_a_directory_prints_no_warning_nor_progress_bar(saved):
    """diffusers warns at every component load that accelerate is missing unless told the option;
    bench/model_load.py measured no gain from it (docs/benchmarks.md), so the worker says it.
    In a process of its own, as the worker's log sees it (diffusers' handler keeps the stderr it
    found at import)."""
    code = f"from render.engine.model import load_model; load_model({str(saved['tiny-sdxl'])!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "accelerate" not in out.stdout + out.stderr
    assert "Loading weights" not in out.stderr  # transformers' progress bar, one per component
