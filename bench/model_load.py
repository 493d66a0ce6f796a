"""How long a Stable-Diffusion-1.5-sized checkpoint takes to load, with and without accelerate.

diffusers initialises a model's weights at random before it reads the checkpoint unless
`low_cpu_mem_usage` is on, which needs accelerate (it builds the modules on the meta device and
fills them from the file). The worker installs accelerate for that; this measures what it saves.

Saves random SD-1.5-sized UNet, VAE and CLIP text encoder (bench/sd15.py, float16) once into a
temporary directory, then loads each diffusers component in a fresh process per run, alternating
the two modes, and prints seconds (median and max of --runs) and the process's peak RSS per
mode side by side.

    .venv/bin/python bench/model_load.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {"unet": "UNet2DConditionModel", "vae": "AutoencoderKL"}
MODES = {"accelerate": True, "without": False}

# One load in a fresh process: the seconds of from_pretrained alone (not of the imports) and the
# process's peak RSS.
LOAD = """
import json, resource, sys, time
import diffusers
root, name, cls, low = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
t = time.perf_counter()
getattr(diffusers, cls).from_pretrained(root, subfolder=name, local_files_only=True, low_cpu_mem_usage=low)
print(json.dumps([time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))
"""


def save(root: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from bench import sd15

    family = sd15.model("cpu")
    family.pipeline(family.make_scheduler(family.defaults.sampler["relax"], 2, 64, 64)).save_pretrained(root)


def load(root: Path, name: str, low: bool) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(root), name, COMPONENTS[name], "1" if low else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    seconds, peak = json.loads(out.stdout.strip().splitlines()[-1])
    return float(seconds), int(peak)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.record import record, variant_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="loads per component and mode")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="turbonode-load-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        save(root)
        print(f"saved SD-1.5-sized components in {time.perf_counter() - t:.1f} s")
        for name in COMPONENTS:
            load(root, name, True)  # warm the page cache: both modes then read from memory
        print(f"{'component':<10} {'mode':<11} {'median s':>9} {'max s':>7} {'peak RSS MiB':>13}   (n={a.runs} each)")
        table = []
        for name in COMPONENTS:
            runs: dict[str, list[tuple[float, int]]] = {m: [] for m in MODES}
            for _ in range(a.runs):
                for mode, low in MODES.items():
                    runs[mode].append(load(root, name, low))
            med = {m: statistics.median(s for s, _ in v) for m, v in runs.items()}
            peak = {m: max(p for _, p in v) / 2**20 for m, v in runs.items()}
            for mode, v in runs.items():
                print(f"{name:<10} {mode:<11} {med[mode]:>9.2f} {max(s for s, _ in v):>7.2f} {peak[mode]:>13.0f}")
                table.append([name, mode, round(med[mode], 2), round(max(s for s, _ in v), 2), round(peak[mode])])
            print(
                f"{name:<10} {'ratio':<11} {med['without'] / med['accelerate']:>8.2f}x {'':>7} "
                f"{peak['without'] / peak['accelerate']:>12.2f}x  (without / accelerate)"
            )
    record(
        "model_load",
        variant=variant_of(ap, a, ("runs",)),
        n=a.runs,
        n_per="loads per component and mode",
        headline="median s: " + ", ".join(f"{r[0]} {r[1]} {r[2]}" for r in table),
        figures={f"{r[0]} {r[1]} median s": r[2] for r in table},
        table={"columns": ["component", "mode", "median s", "max s", "peak RSS MiB"], "rows": table},
        notes="no target: it decides whether the worker needs accelerate (low_cpu_mem_usage)",
    )


if __name__ == "__main__":
    main()
