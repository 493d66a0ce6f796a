"""What the GPU bench scripts share: one run per process written as JSON (`--json`) and kept as a
result (bench/record.py, under the script's name), and `--report` reading those files back to
print them side by side."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.record import flat, record  # noqa: E402

VARIANT_BY = ("mode", "backend", "family", "dry_run")  # what sets a GPU script's runs apart


def load(paths: list[str]) -> list[dict]:
    """The runs in `paths`; a missing or broken file (a stage that failed) is named and skipped."""
    runs = []
    for p in paths:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as exc:
            print(f"skipping {p}: {exc}", file=sys.stderr)
    return runs


def finish(args, run: Callable[[object], dict], report: Callable[[list[dict]], str]) -> int:
    """`--report`: print the table of earlier runs; else run once and write `--json`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.report:
        print(report(load(args.report)))
        return 0
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    parts = [(k, getattr(args, k)) for k in VARIANT_BY if getattr(args, k, None)]
    variant = ", ".join(k.replace("_", "-") if v is True else f"{k} {v}" for k, v in parts)
    record(
        Path(sys.argv[0]).stem,
        variant=variant,
        headline=report([result]).splitlines()[-1][:200],
        figures=flat(result),
        notes="one stage of bench/gpu_check.sh; --report puts the stages side by side (and judges the TensorRT target)",
    )
    return 0
