"""How sure a p99 ratio is: a percentile bootstrap interval of one cell's turbo p99 over another's.

A cell's turbo p99 at n = 300 rests on its 3 slowest answers, so two runs of the same code differ
by more than the 1.2x targets leave room for (issue 37's seed runs: the same engine code gave a
worst cell of 1.04x, 1.23x and 1.28x). The benches print each ratio with this interval so that a
verdict near the bound reads as what it is. Both samples are resampled with replacement, the p99
taken as the benches take it (nearest rank, turbonode/stats.py), DRAWS times from a fixed seed,
so a result file's interval is reproducible from its outcomes. A run prints its report and then
records it: the same pair is bootstrapped once (memoised), not once for each.

Written here rather than taken from scipy.stats.bootstrap: scipy is not a dependency, and its
interval for a ratio of two independent samples' statistics needs the same resampling by hand.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from turbonode.stats import percentile  # noqa: E402
from turbonode.tiers import PROTECTED_TIER  # noqa: E402

DRAWS = 5000  # the ends move by <= 0.03x from one bootstrap seed to another at n = 300 (0.45 s)
LEVEL = 0.95
SEED = 0
LABEL = f"{LEVEL:.0%} CI"


def ratio_interval(
    sample: Sequence[float], reference: Sequence[float], q: float = 99, draws: int = DRAWS, seed: int = SEED
) -> tuple[float, float] | None:
    """The LEVEL interval of percentile(sample, q) / percentile(reference, q); None when either
    sample is empty or a resampled reference percentile is 0."""
    if not sample or not reference:
        return None
    return _bootstrap(tuple(sample), tuple(reference), q, draws, seed)


@functools.lru_cache(maxsize=128)  # holds a run's pairs (cells x workers) from its report to its record
def _bootstrap(
    sample: tuple[float, ...], reference: tuple[float, ...], q: float, draws: int, seed: int
) -> tuple[float, float] | None:
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        ref = percentile(rng.choices(reference, k=len(reference)), q)
        if not ref:
            return None
        ratios.append(percentile(rng.choices(sample, k=len(sample)), q) / ref)
    tail = (1 - LEVEL) / 2 * 100
    low, high = percentile(ratios, tail), percentile(ratios, 100 - tail)
    assert low is not None and high is not None  # draws > 0
    return low, high


def turbo_latencies(outcomes: Iterable[Any]) -> list[float]:
    """The latencies of the turbo requests answered 200 (sandbox.loadgen.Outcome asdict()s): what
    the cells' p99 is taken over."""
    return [o["latency"] for o in outcomes if o["tier"] == PROTECTED_TIER and o["status"] == 200]


def turbo_ratio_interval(cell: Mapping[str, Any] | None, reference: Mapping[str, Any] | None) -> str | None:
    """The interval of a cell's turbo p99 over the reference cell's, from the outcomes each keeps,
    as the tables print it ('0.86-1.13'); None where either kept none."""
    if not cell or not reference or "outcomes" not in cell or "outcomes" not in reference:
        return None
    ends = ratio_interval(turbo_latencies(cell["outcomes"]), turbo_latencies(reference["outcomes"]))
    return None if ends is None else f"{ends[0]:.2f}-{ends[1]:.2f}"


def aside(ends: str | None) -> str:
    """An interval as said after its ratio: ' (95% CI 0.86-1.13)', '' without one."""
    return f" ({LABEL} {ends})" if ends else ""
