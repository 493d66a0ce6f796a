"""bench/gpu_families.py (the SDXL- and Flux-sized rows of bench/gpu_check.sh) where no GPU is.

The full-size configs are checked against the family interface on the meta device (shapes
only, no memory); `--dry-run` runs the script's own code on the CPU with the tiny variants.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

SCRIPT = ROOT / "bench" / "gpu_families.py"


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name,params_b,shapes",
    [
        (
            "sdxl",
            2.567,
            {
                "sample": (2, 4, 128, 128),
                "encoder_hidden_states": (2, 77, 2048),
                "text_embeds": (2, 1280),
                "time_ids": (2, 6),
            },
        ),
        (
            "flux",
            11.891,
            {
                "sample": (2, 4096, 64),
                "encoder_hidden_states": (2, 256, 4096),
                "pooled_projections": (2, 768),
                "img_ids": (4096, 3),
                "txt_ids": (256, 3),
            },
        ),
    ],
)
def test_full_size_configs_fit_the_family_interface(name, params_b, shapes):
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    from render.engine.backends.onnx_export import example_inputs

    bench = _bench()
    _, denoiser, config, _ = bench.FULL[name]
    with torch.device("meta"):  # the real architecture, no weights allocated
        model = (UNet2DConditionModel if name == "sdxl" else FluxTransformer2DModel)(**config)
    fam = bench.build_family(name, "cpu", dry_run=True)
    fam.parts.modules[denoiser] = model
    if name == "flux":
        fam.parts.modules["tokenizer_2"].model_max_length = bench.FLUX_TEXT_LEN
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - params_b) < 0.001
    got = fam.input_shapes(2, 1024, 1024)
    assert {k: got[k] for k in shapes} == shapes
    with torch.inference_mode():
        out = fam.denoiser_module()(*example_inputs(fam, 2, 1024, 1024, torch.device("meta"), torch.float32))
    assert tuple(out.shape) == shapes["sample"]


def test_gpu_check_dry_runs_the_family_rows_without_a_gpu(tmp_path):
    """bench/gpu_check.sh's SDXL- and Flux-sized rows, dry-run on the CPU with the tiny variants."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUT": str(tmp_path),
        "GPU_CHECK_DRY_RUN": "1",
        "PYTHON": sys.executable,
    }
    run = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "sdxl: exit 0" in run.stdout and "flux: exit 0" in run.stdout
    for name in ("sdxl", "flux"):
        data = json.loads((tmp_path / f"family_{name}.json").read_text())
        assert data["device"] == "cpu (dry run)" and [r["rows"] for r in data["results"]] == [1, 4]
    rows = [
        line for line in (tmp_path / "report.txt").read_text().splitlines() if line.strip().startswith(("sdxl", "flux"))
    ]
    assert len(rows) == 4
    report = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(tmp_path / "missing.json")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert report.returncode == 0 and "missing.json" in report.stderr and "no family runs" in report.stdout
