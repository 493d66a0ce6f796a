"""Small statistics shared by the worker's status figures and the demo's load summary."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a small sample; None when empty."""
    data = sorted(values)
    if not data:
        return None
    return data[min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))]
