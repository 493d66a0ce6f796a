"""docs/benchmarks.md against bench/results/: the page's generated sections are what the latest
result of each benchmark gives (bench/page.py), it stays within 400 lines, and every result file
is a valid one (bench/record.py); and the record and page code themselves."""

from __future__ import annotations

import argparse
import datetime as dt
import json

import pytest

from bench import page, record

RESULTS = sorted(record.RESULTS.glob("*/*.json"))


def test_the_page_is_what_the_latest_results_give():
    assert page.problems(page.PAGE.read_text(), record.latest()) == []


def test_the_page_is_at_most_400_lines():
    assert len(page.PAGE.read_text().splitlines()) <= page.MAX_LINES


@pytest.mark.parametrize("path", RESULTS, ids=[f"{p.parent.name}/{p.name}" for p in RESULTS])
def test_every_result_file_is_a_result(path):
    result = json.loads(path.read_text())
    assert record.validate(result) == []
    assert path.parent.name == result["benchmark"] and path.name == record.file_name(result)


def test_transcribed_results_say_where_from_and_were_not_rerun():
    transcribed = [r for r in record.load() if r["transcribed"]]
    assert transcribed, "the seeded results are there"
    for r in transcribed:
        assert r["transcribed"] == "docs/benchmarks.md at 59b0ea8 (not re-run)" and r["dirty"] is None
        assert r["source"] and r["source"]["section"] and r["source"]["run"]


def _result(tmp_path, monkeypatch, benchmark="node_slo", when="2026-12-05T10:00:00", **kw):
    monkeypatch.setattr(record, "checkout", lambda: ("abc1234", False))
    kw.setdefault("headline", "h")
    kw.setdefault("figures", {"p99 ms": 400})
    r = record.make(benchmark, now=dt.datetime.fromisoformat(when).replace(tzinfo=dt.UTC), command="python x", **kw)
    return record.write(r, tmp_path)


def test_a_result_is_named_by_time_and_commit_and_the_latest_wins(tmp_path, monkeypatch):
    old = _result(tmp_path, monkeypatch, when="2026-12-05T09:00:00", figures={"p99 ms": 500})
    new = _result(tmp_path, monkeypatch, when="2026-12-05T10:00:00", n=100, seed=22, target="t", met=True)
    other = _result(tmp_path, monkeypatch, when="2026-12-05T08:00:00", variant="workers 2")
    assert [old.name, new.name] == ["20261205T090000Z-abc1234.json", "20261205T100000Z-abc1234.json"]
    assert other.parent == new.parent == tmp_path / "node_slo"
    latest = record.latest(tmp_path)
    assert set(latest) == {("node_slo", ""), ("node_slo", "workers 2")}
    got = latest[("node_slo", "")]
    assert (got["figures"], got["n"], got["seed"], got["met"], got["commit"]) == (
        {"p99 ms": 400},
        100,
        22,
        True,
        "abc1234",
    )
    assert got["date"] == "2026-12-05T10:00:00Z" and got["transcribed"] is None


def test_a_result_that_is_not_one_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="figure p99 is list"):
        _result(tmp_path, monkeypatch, figures={"p99": [1, 2]})
    with pytest.raises(ValueError, match="benchmark 'Node SLO'"):
        _result(tmp_path, monkeypatch, benchmark="Node SLO")
    bad = json.loads(_result(tmp_path, monkeypatch).read_text()) | {"met": "yes", "extra": 1}
    assert record.validate(bad) == ["extra unknown", "met is str"]
    undated = bad | {"date": None, "commit": None}
    assert record.file_name(undated) == "00000000T000000Z-unknown.json"  # sorts before every dated run


def test_under_pytest_nothing_is_written_unless_bench_results_says_where(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_RESULTS", raising=False)
    assert record.record("node_slo", headline="h", figures={}) is None
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    path = record.record("node_slo", headline="h", figures={}, command="python bench/node_slo.py")
    assert path is not None and path.parent == tmp_path / "node_slo"


def test_a_variant_is_the_options_off_their_defaults():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="none,cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--json")
    ap.add_argument("--eager", action="store_true")
    assert record.variant_of(ap, ap.parse_args(["--seed", "7", "--json", "x"])) == ""
    assert record.variant_of(ap, ap.parse_args(["--workers", "2", "--cells", "gc", "--eager"])) == (
        "cells gc, workers 2, eager"
    )


def test_flat_keeps_the_scalars_and_leaves_samples_out():
    nested = {"a": {"p99": 1.5, "samples": [1, 2]}, "b": None, "skip": {"x": 1}}
    assert record.flat(nested, skip=("skip",)) == {"a p99": 1.5, "b": None}


def test_the_page_check_fails_on_a_stale_figure_and_a_missing_section(tmp_path, monkeypatch):
    _result(tmp_path, monkeypatch, n=100, target="p99 <= 2x", met=True)
    results = record.latest(tmp_path)
    text = "# B\n<!-- results: glance -->\n<!-- end results: glance -->\n<!-- results: node_slo -->\nold\n"
    text += "<!-- end results: node_slo -->\n<!-- results: attainment -->\n<!-- end results: attainment -->\n"
    missing = {name for name in page.ORDER if name != "node_slo"}
    stale = page.problems(text, results)
    assert "section node_slo is not what its results give (python bench/page.py)" in stale
    fresh = page.update(text, page.render(results))
    assert "**Latest**, 2026-12-05 10:00 UTC, abc1234: **met**. n = 100" in fresh and "old" not in fresh
    assert {p.split()[3] for p in page.problems(fresh, results)} == missing  # no section for them: named
    full = fresh + "".join(f"<!-- results: {n} -->\n<!-- end results: {n} -->\n" for n in sorted(missing))
    assert page.problems(page.update(full, page.render(results)), results) == []
    long = page.update(full, page.render(results)) + "x\n" * page.MAX_LINES
    assert page.problems(long, results)[-1].endswith(f"over {page.MAX_LINES}")


def test_the_page_shows_attainment_per_cell_and_none_for_an_empty_tier(tmp_path, monkeypatch):
    table = {
        "columns": ["cell", "mode", "p99 ms", "turbo SLO", "fast SLO"],
        "rows": [["none", "plain", 500, "90.0%", "none"], ["none", "turbonode", 400, "100.0%", "none"]],
    }
    verdicts = [{"target": "turbo SLO attainment >= 99.9%", "value": "met in 1/1", "met": True}]
    _result(tmp_path, monkeypatch, table=table, verdicts=verdicts, met=True)
    lines = page.attainment(record.latest(tmp_path))
    assert lines[0].startswith("- node_slo, 2026-12-05 10:00 UTC, abc1234: turbo met in 1/1 (**met**)")
    assert lines[1:] == ["  - turbo SLO: none 100.0%", "  - fast SLO: none none"]
    shown = page.compact(table["columns"], table["rows"])
    assert shown[0] == ["cell", "p99 ms, plain", "p99 ms, turbonode", "turbo SLO, plain", "turbo SLO, turbonode"] + [
        "fast SLO, plain",
        "fast SLO, turbonode",
    ]
    assert shown[1] == [["none", 500, 400, "90.0%", "100.0%", "none", "none"]]


def test_one_attainment_everywhere_is_said_once_and_the_block_leaves_it_to_the_lead(tmp_path, monkeypatch):
    table = {
        "columns": ["cell", "mode", "p99 ms", "turbo SLO", "fast SLO"],
        "rows": [["none", "turbonode", 400, "100.0%", "100.0%"], ["gc", "turbonode", 500, "100.0%", "100.0%"]],
    }
    verdicts = [
        {"target": "turbonode turbo p99 <= 2x the none p99", "value": "met in 1/1", "met": True},
        {"target": "turbo SLO attainment >= 99.9%", "value": "met in 2/2", "met": True},
    ]
    _result(tmp_path, monkeypatch, table=table, verdicts=verdicts, met=True)
    (r,) = record.latest(tmp_path).values()
    lines = page.attainment({("node_slo", ""): r})
    assert lines == [
        "- node_slo, 2026-12-05 10:00 UTC, abc1234: turbo met in 2/2 (**met**); "
        "turbo SLO and fast SLO 100.0% in every cell"
    ]
    shown = page.block(r)
    assert "- turbonode turbo p99 <= 2x the none p99: met in 1/1 (**met**)" in shown
    assert not any("SLO attainment" in line for line in shown)
