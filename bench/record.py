"""A benchmark's result as data: one JSON file per run under bench/results/<benchmark>/, named
<UTC timestamp>-<commit>.json so that names sort by time; docs/benchmarks.md shows the latest of
each (bench/page.py). Every bench script calls `record` once its run is done.

A result file (SCHEMA 1):

    schema      1
    benchmark   the script's name: node_slo, fleet_slo, capacity, ... (its directory)
    variant     "" for the script's default run; else what sets this run apart (e.g. "workers 2"):
                the page shows the latest result of each variant
    command     the command line that ran it
    commit      short hash of the checkout that ran (null: not known)
    dirty       whether that checkout had uncommitted changes to tracked files (null: not known)
    date        when it ran, ISO 8601 UTC ("2026-12-03T13:53:00Z"; a day alone where that is all
                that is known; null: not known)
    n           the sample size (null: not given), `n_per` what it counts
    seed        the random seed of its arrivals or inputs (null: none, or not given)
    headline    one line of the figures that matter, for the page's table
    figures     {name: number, string or null}: the figures, flat
    table       null, or {"columns": [...], "rows": [[...], ...]}: the figures per cell
    target      the target(s) as text (null: none of its own)
    met         true/false: every target met or not; null: no target, or not judged
    verdicts    [{"target", "value", "met"}]: one per target where there are several
    transcribed null for a run; for a result copied from the docs, where from (not re-run)
    source      null, or for a transcribed one where in the doc and the run's date as the doc gives it
    notes       null, or what a reader needs beside the figures

`BENCH_RESULTS` (an environment variable) moves the directory; `BENCH_COMMIT` names the commit
where the tree has no git (a device machine's copy). Under pytest (PYTEST_CURRENT_TEST) without
BENCH_RESULTS nothing is written: a test that runs a script's main leaves the checkout alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCHEMA = 1
FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (int,),
    "benchmark": (str,),
    "variant": (str,),
    "command": (str, type(None)),
    "commit": (str, type(None)),
    "dirty": (bool, type(None)),
    "date": (str, type(None)),
    "n": (int, type(None)),
    "n_per": (str, type(None)),
    "seed": (int, type(None)),
    "headline": (str,),
    "figures": (dict,),
    "table": (dict, type(None)),
    "target": (str, type(None)),
    "met": (bool, type(None)),
    "verdicts": (list,),
    "transcribed": (str, type(None)),
    "source": (dict, type(None)),
    "notes": (str, type(None)),
}
NAME = re.compile(r"^[a-z0-9_]+$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?$")


def results_dir() -> Path | None:
    """Where results go; None under pytest unless BENCH_RESULTS says where."""
    if os.environ.get("BENCH_RESULTS"):
        return Path(os.environ["BENCH_RESULTS"])
    return None if "PYTEST_CURRENT_TEST" in os.environ else RESULTS


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def checkout() -> tuple[str | None, bool | None]:
    """The commit that runs (short hash) and whether tracked files differ from it."""
    commit = os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    with_root = script.resolve().is_relative_to(ROOT)
    return shlex.join(["python", str(script.resolve().relative_to(ROOT)) if with_root else argv[0], *argv[1:]])


# arguments that say where output goes, or that vary a run without making it another experiment
NOT_VARIANT = frozenset({"json", "json_out", "report", "keep_logs", "logs", "seed", "record"})


def variant_of(parser: argparse.ArgumentParser, args: argparse.Namespace, also_not: tuple[str, ...] = ()) -> str:
    """The options of `args` that differ from `parser`'s defaults, as "name value, ...": a run's variant."""
    parts = []
    for name, value in vars(args).items():
        if name in NOT_VARIANT or name in also_not or value == parser.get_default(name):
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else value
        parts.append(name.replace("_", "-") if value is True else f"{name.replace('_', '-')} {shown}")
    return ", ".join(parts)


def make(
    benchmark: str,
    *,
    headline: str,
    figures: dict[str, Any],
    target: str | None = None,
    met: bool | None = None,
    verdicts: list[dict[str, Any]] | None = None,
    n: int | None = None,
    n_per: str | None = None,
    seed: int | None = None,
    variant: str = "",
    table: dict[str, list[Any]] | None = None,
    notes: str | None = None,
    command: str | None = None,
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """A result of a run of this checkout, now."""
    commit, dirty = checkout()
    when = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).replace(microsecond=0)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "variant": variant,
        "command": command_line() if command is None else command,
        "commit": commit,
        "dirty": dirty,
        "date": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "n": n,
        "n_per": n_per,
        "seed": seed,
        "headline": headline,
        "figures": figures,
        "table": table,
        "target": target,
        "met": met,
        "verdicts": verdicts or [],
        "transcribed": None,
        "source": None,
        "notes": notes,
    }


def ms_int(seconds: float | None) -> int | None:
    """Seconds as whole milliseconds, as the result tables keep them."""
    return None if seconds is None else round(seconds * 1000)


def judged(verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    """`target`, `met` and `verdicts` of a result from its verdicts: the targets joined, met when every
    judged one is (None when none is judged)."""
    mets = [v["met"] for v in verdicts if v["met"] is not None]
    return {
        "target": "; ".join(v["target"] for v in verdicts) or None,
        "met": all(mets) if mets else None,
        "verdicts": verdicts,
    }


def flat(obj: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A nested result's scalars as {"outer inner": value}; lists (samples, outcomes) and `skip`ped keys left out."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if str(k) not in skip:
                out.update(flat(v, f"{prefix} {k}".strip(), skip))
        return out
    if isinstance(obj, bool | int | float | str) or obj is None:
        return {prefix: obj}
    return {}


def file_name(result: dict[str, Any]) -> str:
    """<UTC timestamp>-<commit>.json; an undated result sorts before every dated one."""
    date = result["date"] or ""
    stamp = date.replace("-", "").replace(":", "") if "T" in date else (date.replace("-", "") + "T000000Z")
    commit = re.sub(r"[^0-9A-Za-z]+", "-", result["commit"] or "unknown")
    return f"{stamp if date else '00000000T000000Z'}-{commit}.json"


def write(result: dict[str, Any], directory: Path) -> Path:
    problems = validate(result)
    if problems:
        raise ValueError(f"not a result: {'; '.join(problems)}")
    folder = directory / result["benchmark"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(result)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return path


def record(benchmark: str, **kwargs: Any) -> Path | None:
    """Write this run's result (see `make`) and say where (None: under pytest, not written)."""
    result, directory = make(benchmark, **kwargs), results_dir()
    if directory is None:
        print("result not kept (under pytest; BENCH_RESULTS would say where)", file=sys.stderr)
        return None
    path = write(result, directory)
    print(f"result: {path}", file=sys.stderr)
    return path


def validate(result: dict[str, Any]) -> list[str]:
    """What makes `result` not a result file of SCHEMA (empty: nothing)."""
    problems = [f"{k} missing" for k in FIELDS if k not in result]
    problems += [f"{k} unknown" for k in result if k not in FIELDS]
    problems += [
        f"{k} is {type(result[k]).__name__}"
        for k, kinds in FIELDS.items()
        if k in result and (not isinstance(result[k], kinds) or (isinstance(result[k], bool) and bool not in kinds))
    ]
    if problems:
        return problems
    if result["schema"] != SCHEMA:
        problems.append(f"schema {result['schema']}")
    if not NAME.match(result["benchmark"]):
        problems.append(f"benchmark {result['benchmark']!r}")
    if result["date"] is not None and not DATE.match(result["date"]):
        problems.append(f"date {result['date']!r}")
    for k, v in result["figures"].items():
        if not isinstance(v, str | int | float | type(None)):
            problems.append(f"figure {k} is {type(v).__name__}")
    table = result["table"]
    if table is not None and (
        set(table) != {"columns", "rows"} or any(len(row) != len(table["columns"]) for row in table["rows"])
    ):
        problems.append("table: columns and rows do not match")
    for v in result["verdicts"]:
        if not isinstance(v, dict) or set(v) != {"target", "value", "met"}:
            problems.append(f"verdict {v!r}")
    return problems


def load(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every result file, oldest first within each benchmark (file names sort by time)."""
    base = directory or RESULTS
    out = []
    for path in sorted(base.glob("*/*.json")):
        result = json.loads(path.read_text())
        result["_path"] = str(path.relative_to(base))
        out.append(result)
    return out


def latest(directory: Path | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """The newest result of each (benchmark, variant)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for result in load(directory):
        out[(result["benchmark"], result["variant"])] = result
    return out
