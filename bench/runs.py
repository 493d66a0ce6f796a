"""What the GPU bench scripts share: one run per process written as JSON (`--json`), and
`--report` reading those files back to print them side by side."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path


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
    return 0
