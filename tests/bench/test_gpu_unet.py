"""The GPU bench's side-by-side report, from run files like those gpu_check.sh collects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def _run_file(path: Path, mode: str, calls_per_s: dict[int, float]) -> str:
    results = [
        {
            "batch": b,
            "mean_ms": 1000 / v,
            "p50_ms": 1000 / v,
            "p99_ms": 1100 / v,
            "unet_calls_per_s": v,
            "sample_steps_per_s": b * v,
            "first_call_s": 1.0,
        }
        for b, v in calls_per_s.items()
    ]
    path.write_text(
        json.dumps(
            {
                "mode": mode,
                "gpu": "NVIDIA H200",
                "compute_capability": "9.0",
                "torch": "2.11.0+cu130",
                "size": 512,
                "iters": 30,
                "setup_s": 2.0,
                "info": {},
                "results": results,
            }
        )
    )
    return str(path)


def _report(*paths: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_unet.py"), "--report", *paths],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_report_puts_modes_side_by_side_with_ratios_and_the_target(tmp_path):
    eager = _run_file(tmp_path / "eager.json", "eager", {1: 20.0, 4: 8.0, 8: 4.5})
    trt = _run_file(tmp_path / "tensorrt.json", "tensorrt", {1: 40.0, 4: 14.0, 8: 9.0})
    out = _report(eager, trt, str(tmp_path / "compile.json"))  # compile stage produced nothing
    assert out.returncode == 0, out.stderr
    assert "skipping" in out.stderr and "compile.json" in out.stderr
    lines = out.stdout.splitlines()
    assert "NVIDIA H200" in lines[0]
    row4 = next(line for line in lines if line.strip().startswith("4 |"))
    assert "8.00" in row4 and "14.00" in row4 and "1.75x" in row4
    assert "batch 1: TensorRT 2.00x eager (meets the 1.8x target)" in lines
    assert "batch 4: TensorRT 1.75x eager (misses the 1.8x target)" in lines


def test_report_without_tensorrt_says_so(tmp_path):
    out = _report(_run_file(tmp_path / "eager.json", "eager", {1: 20.0}))
    assert "TensorRT: no result" in out.stdout
