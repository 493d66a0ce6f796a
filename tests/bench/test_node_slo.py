"""bench/node_slo.py --workers: which worker each cell's verdict judges (issue 22's targets)."""

from __future__ import annotations

from bench.node_slo import report_workers


def _worker(p99_s: float, reasons: list[str]) -> tuple[dict, dict]:
    figures = {"tiers": {"turbo": {"ok": 100, "p50_s": p99_s / 2, "p99_s": p99_s, "max_s": p99_s}}}
    seen = {
        "max_level": "pressured" if reasons else "normal",
        "reasons": reasons,
        "throttled_share": 1.0 if reasons else 0.0,
        "levers": {},
    }
    return figures, seen


def _result(p99: dict[str, dict[str, float]], reasons: dict[str, dict[str, list[str]]]) -> dict:
    cells = {}
    for cell, by_worker in p99.items():
        made = {name: _worker(v, reasons.get(cell, {}).get(name, [])) for name, v in by_worker.items()}
        cells[cell] = {
            "turbonode": {
                "workers": {name: figures for name, (figures, _) in made.items()},
                "agent": {"workers": {name: seen for name, (_, seen) in made.items()}},
            }
        }
    return {"cells": cells, "modes": ["turbonode"], "knobs": {}, "loadavg_before": [0, 0, 0]}


def test_a_own_faults_in_all_are_shown_apart_and_the_others_judged_against_2x():
    text = report_workers(
        _result(
            {
                "none": {"a": 0.4, "b": 0.4},
                "gc": {"a": 0.84, "b": 0.42},
                "cpu-bulk": {"a": 0.41, "b": 0.36},
                "all": {"a": 1.1, "b": 0.9},
            },
            {"gc": {"a": ["cpu_load", "gc_pause_s"], "b": ["cpu_load"]}},
        )
    )
    assert "every other worker's p99 <= 1.1 x its none: b 1.05x - met" in text
    assert "a throttled 100% (cpu_load, gc_pause_s - its own), b throttled 100% (cpu_load)" in text
    # cpu-bulk for both, `all` for b (a's faults are not b's): 3 verdicts; b's 2.25x in `all` misses
    assert "every worker's p99 <= 2 x its none: met in 2/3; missed: all/b 2.25x" in text
    assert "with a's own faults too (no target: gc, relax-flood are a's, not the node's): all/a 2.75x" in text
