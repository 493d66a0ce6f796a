"""bench/interval.py: the bootstrap interval printed beside every p99 ratio."""

from __future__ import annotations

import random

from bench import interval


def _sample(seed: int, n: int = 300, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(-1, 0.4) for _ in range(n)]


def test_the_interval_holds_the_ratio_and_is_the_same_from_the_same_seed():
    slow, idle = _sample(1, scale=1.3), _sample(2)
    low, high = interval.ratio_interval(slow, idle)
    ratio = sorted(slow)[296] / sorted(idle)[296]  # nearest-rank p99 of 300: the 297th
    assert low < ratio < high
    assert interval.ratio_interval(slow, idle) == (low, high)
    assert interval.ratio_interval(slow, idle, seed=1) != (low, high)


def test_a_sample_against_itself_spans_one_and_a_slower_one_lies_above_it():
    idle = _sample(3)
    low, high = interval.ratio_interval(idle, idle)
    assert low < 1.0 < high
    low, _ = interval.ratio_interval([2 * x for x in idle], idle)
    assert low > 1.0


def test_ends_move_little_from_one_bootstrap_seed_to_another_at_n_300():
    slow, idle = _sample(4, scale=1.2), _sample(5)
    ends = [interval.ratio_interval(slow, idle, seed=s) for s in range(3)]
    assert max(e[0] for e in ends) - min(e[0] for e in ends) <= 0.03
    assert max(e[1] for e in ends) - min(e[1] for e in ends) <= 0.03


def test_no_interval_without_answered_turbo_requests():
    ok = {"outcomes": [{"tier": "turbo", "status": 200, "latency": 0.3}] * 10}
    refused = {"outcomes": [{"tier": "turbo", "status": 503, "latency": 0.01}] * 10}
    assert interval.turbo_ratio_interval(ok, refused) is None
    assert interval.turbo_ratio_interval(ok, {"tiers": {}}) is None  # a run saved without outcomes
    assert interval.turbo_ratio_interval(ok, ok) == "1.00-1.00"
