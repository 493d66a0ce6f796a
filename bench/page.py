"""docs/benchmarks.md's generated sections, from the latest result of each benchmark and variant
(bench/record.py, bench/results/).

    .venv/bin/python bench/page.py           # rewrite the generated sections in place
    .venv/bin/python bench/page.py --check   # exit 1 and say why when page and results disagree

A generated section lies between `<!-- results: NAME -->` and `<!-- end results: NAME -->`: NAME is
`attainment` (SLO attainment, the page's lead), `glance` (one row per benchmark and variant) or a
benchmark's directory under bench/results/. Everything outside the markers is written by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.record import RESULTS, latest  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
MAX_LINES = 400
# the page's order; a benchmark not named here comes after these, by name
ORDER = (
    "node_slo",
    "fleet_slo",
    "capacity",
    "capacity_bound",
    "accounts",
    "detection",
    "qos_latency",
    "worker_sched",
    "worker_turbo",
    "channel_codec",
    "worker_rss",
    "graph_gil",
    "model_load",
    "onnx_cpu",
    "demo",
    "gpu_unet",
    "gpu_e2e",
    "gpu_families",
    "fault_panels",
)
ATTAINMENT_FROM = ("node_slo", "fleet_slo")
# benchmarks shown under another's heading
LINK = {
    "capacity_bound": "capacity",
    "channel_codec": "worker_turbo",
    "gpu_e2e": "gpu_unet",
    "gpu_families": "gpu_unet",
}
TABLES = ("node_slo", "fleet_slo", "capacity")  # whose default run's table the page shows (400 lines)
SLO_COLUMNS = ("turbo SLO", "fast SLO")
BLOCK = re.compile(r"(<!-- results: (\S+) -->\n)(.*?)(<!-- end results: \2 -->)", re.S)

Latest = dict[tuple[str, str], dict[str, Any]]


def _v(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _met(met: bool | None) -> str:
    return "–" if met is None else "**met**" if met else "**not met**"


def _cell(value: Any) -> str:
    return _v(value).replace("|", "/").replace("\n", " ")


def _ordered(results: Latest) -> list[dict[str, Any]]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return [results[k] for k in sorted(results, key=lambda k: (rank.get(k[0], len(ORDER)), k[0], k[1] != "", k[1]))]


def _when(r: dict[str, Any]) -> str:
    date = (r["date"] or "date not given").replace("T", " ").replace(":00Z", " UTC")
    return f"{date}, {r['commit'] or 'commit not given'}" + (", uncommitted changes" if r["dirty"] else "")


def _n(r: dict[str, Any]) -> str:
    return "–" if r["n"] is None else f"{r['n']}" + (f" {r['n_per']}" if r["n_per"] else "")


def table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(x) for x in row) + " |" for row in rows),
    ]


def compact(columns: list[str], rows: list[list[Any]]) -> tuple[list[str], list[list[Any]]]:
    """A result table as the page shows it: with several modes, one row per cell and each figure per
    mode side by side ("p99 ms, turbonode"); columns with no value at all left out."""
    if "mode" in columns and len(modes := list(dict.fromkeys(row[columns.index("mode")] for row in rows))) > 1:
        at = columns.index("mode")
        keys, values = columns[:at], columns[at + 1 :]
        by_key: dict[tuple[Any, ...], dict[Any, list[Any]]] = {}
        for row in rows:
            by_key.setdefault(tuple(row[:at]), {})[row[at]] = row[at + 1 :]
        columns = keys + [f"{c}, {m}" for c in values for m in modes]
        rows = [
            [*key, *(got.get(m, [None] * len(values))[i] for i in range(len(values)) for m in modes)]
            for key, got in by_key.items()
        ]
    keep = [i for i in range(len(columns)) if any(row[i] is not None for row in rows)]
    return [columns[i] for i in keep], [[row[i] for i in keep] for row in rows]


def attainment(results: Latest) -> list[str]:
    """The lead: per benchmark and variant with SLO columns, each tier's attainment per cell (turbonode)."""
    lines, before = [], []
    for r in _ordered(results):
        if r["benchmark"] not in ATTAINMENT_FROM:
            continue
        name = r["benchmark"] + (f" ({r['variant']})" if r["variant"] else "")
        t = r["table"] or {"columns": [], "rows": []}
        cols = t["columns"]
        rows = [row for row in t["rows"] if "mode" in cols and row[cols.index("mode")] == "turbonode"]
        slos = {c: [row[cols.index(c)] for row in rows] for c in SLO_COLUMNS if c in cols}
        if all(x is None for xs in slos.values() for x in xs):
            before.append(f"{name} ({r['commit'] or 'commit not given'})")
            continue
        cell = [i for i, c in enumerate(cols) if c in ("cell", "worker")]
        verdicts = [v for v in r["verdicts"] if _is_slo(v)]
        lines.append(
            f"- {name}, {_when(r)}: "
            + "; ".join(f"{v['target'].split()[0]} {v['value']} ({_met(v['met'])})" for v in verdicts)
        )
        if len({x for xs in slos.values() for x in xs}) == 1:  # one value everywhere (100 %): said once
            lines[-1] += f"; {' and '.join(slos)} {_v(next(iter(slos.values()))[0])} in every cell"
            continue
        for c, xs in slos.items():
            cells = ", ".join(f"{'/'.join(str(row[i]) for i in cell)} {_v(x)}" for row, x in zip(rows, xs))
            lines.append(f"  - {c}: {cells}")
    if before:
        lines.append(f"- not measured (the runs predate attainment): {'; '.join(before)}")
    return lines or ["No result has SLO attainment yet."]


def glance(results: Latest) -> list[str]:
    rows = [
        [f"[{r['benchmark']}](#{LINK.get(r['benchmark'], r['benchmark'])})", r["variant"] or "default", r["headline"]]
        + [_met(r["met"]), _n(r), r["seed"], _when(r) + (" (transcribed)" if r["transcribed"] else "")]
        for r in _ordered(results)
    ]
    return table(["benchmark", "variant", "latest", "met", "n", "seed", "date, commit"], rows)


def _is_slo(verdict: dict[str, Any]) -> bool:
    return "SLO attainment" in verdict["target"]


def block(r: dict[str, Any]) -> list[str]:
    """One benchmark variant's latest result."""
    variant = f" ({r['variant']})" if r["variant"] else ""
    lines = [f"**Latest{variant}**, {_when(r)}: {_met(r['met'])}. n = {_n(r)}; seed {_v(r['seed'])}."]
    if r["transcribed"]:
        lines[0] += f" *Transcribed from {r['transcribed']}.*"
    link = f" ([result](../bench/results/{r['_path']}))" if r.get("_path") else ""
    lines.append((f"`{r['command']}`" if r["command"] else "Command not given.") + link)
    # the SLO attainment verdicts are the page's lead (attainment): not repeated here
    lines += [f"- {v['target']}: {v['value']} ({_met(v['met'])})" for v in r["verdicts"] if not _is_slo(v)]
    if r["target"] and not r["verdicts"]:
        lines.append(f"- target: {r['target']}")
    shown = r["table"] is not None and not r["variant"] and r["benchmark"] in TABLES  # the rest: in its file
    if not shown and not r["verdicts"]:
        lines.append(f"- {r['headline']}")
    if r["notes"]:
        lines.append(f"- {r['notes']}")
    if shown:
        lines += ["", *table(*compact(r["table"]["columns"], r["table"]["rows"]))]
    return lines


def render(results: Latest) -> dict[str, str]:
    """Every generated section's text, by marker name."""
    sections = {"attainment": attainment(results), "glance": glance(results)}
    sections |= {name: ["No result yet."] for name in ORDER if name not in {k[0] for k in results}}
    for r in _ordered(results):
        sections.setdefault(r["benchmark"], [])
        if sections[r["benchmark"]]:
            sections[r["benchmark"]].append("")
        sections[r["benchmark"]] += block(r)
    return {name: "\n".join(lines) + "\n" for name, lines in sections.items()}


def update(text: str, sections: dict[str, str]) -> str:
    """`text` with each marked section replaced (a marked name without results: emptied)."""
    return BLOCK.sub(lambda m: m.group(1) + sections.get(m.group(2), "") + m.group(4), text)


def problems(text: str, results: Latest) -> list[str]:
    """How the page and the results disagree (empty: they agree)."""
    sections = render(results)
    marked = [m.group(2) for m in BLOCK.finditer(text)]
    out = [f"no section for {name} (<!-- results: {name} -->)" for name in sections if name not in marked]
    stale = [m.group(2) for m in BLOCK.finditer(text) if m.group(3) != sections.get(m.group(2), "")]
    out += [f"section {name} is not what its results give (python bench/page.py)" for name in stale]
    if (lines := len(text.splitlines())) > MAX_LINES:
        out.append(f"{lines} lines, over {MAX_LINES}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when the page is not up to date")
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    text, results = args.page.read_text(), latest(args.results)
    if args.check:
        found = problems(text, results)
        print("\n".join(found) or f"{args.page}: up to date")
        return 1 if found else 0
    args.page.write_text(update(text, render(results)))
    found = problems(args.page.read_text(), results)
    print("\n".join(found) or f"{args.page}: written")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
