"""bench/capacity_bound.py: the ideal servers' queues, and the bound it prints."""

from __future__ import annotations

import argparse
import sys

import pytest

from bench import capacity_bound as cb


def test_best_rate_queues_only_what_overlaps():
    # spaced wider than the service: each waits for nothing; two at once: the second waits one service
    assert cb.best_rate([0.0, 1.0, 2.0], 0.5) == [0.5, 0.5, 0.5]
    assert cb.best_rate([0.0, 0.0, 2.0], 0.5) == [0.5, 1.0, 0.5]


def test_batching_takes_what_waits_up_to_the_best_batch():
    # three at once, batches of at most 2: two together in 2/4 s, the third alone after them in 1 s
    assert cb.batching([0.0, 0.0, 0.0], {1: 1.0, 2: 4.0}) == [0.5, 0.5, 1.5]
    # a batch of 3 is slower per image than one of 2: never formed
    assert cb.batching([0.0, 0.0, 0.0], {1: 1.0, 2: 4.0, 3: 2.0}) == [0.5, 0.5, 1.5]
    # one arriving while a batch runs waits for its end, then runs alone
    assert cb.batching([0.0, 0.1], {1: 2.0, 2: 3.0}) == pytest.approx([0.5, 0.9])


def test_the_bound_falls_with_the_objective():
    raw = {1: 5.0, 2: 7.0}
    loose = cb.bound(raw, slo_s=1e9, floor_s=0.0, n=2000)
    assert loose["limit"] == 7.0 and loose["capacity"] == {"best_rate": 1.0, "batching": 1.0}
    p99s = [r["best_rate_p99_s"] for r in loose["rows"]]
    assert p99s == sorted(p99s)  # a queue only grows with the load
    # below one image's own time nothing holds; the floor counts against the objective
    assert cb.bound(raw, slo_s=0.1, floor_s=0.0, n=2000)["capacity"] == {"best_rate": None, "batching": None}
    tight = cb.bound(raw, slo_s=1.0, floor_s=0.0, n=2000)["capacity"]["best_rate"]
    floored = cb.bound(raw, slo_s=1.0, floor_s=0.5, n=2000)["capacity"]["best_rate"]
    assert tight is not None and (floored is None or floored < tight)


@pytest.mark.parametrize("text", ["2:7.0", "1:5,3:7", "1:0", "a:b", ""])
def test_raw_rates_name_what_is_wrong(text):
    with pytest.raises(argparse.ArgumentTypeError, match="batch size|B:images_per_s"):
        cb._raw(text)


def test_main_prints_the_rungs_and_the_verdict(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["capacity_bound", "--raw", "1:5.49,2:7.27", "--arrivals", "2000"])
    assert cb.main() == 0
    out = capsys.readouterr().out
    assert "raw limit 7.27 images/s" in out and "n = 2000" in out
    assert out.count("%") >= len(cb.RUNGS) and "best_rate: capacity" in out and "batching: capacity" in out
