"""SLO attainment, the benchmarks' headline: per tier, the share of its requests answered within
the tier's objective. A refused request (429/503) or an error (any other answer, none at all)
is a miss; a tier with no requests has no attainment (None), not 100 %.

The objectives are defined here once for every bench script: turbo's is the worker's own
default (`worker.slo`, turbonode/config.py); the worker has none for fast by default, so the
benchmarks' is set here (bench/fleet_slo.py gives it to its workers as `worker.slo.fast`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from turbonode.config import WorkerConfig  # noqa: E402
from turbonode.tiers import PROTECTED_TIER  # noqa: E402

OBJECTIVE_S: dict[str, float] = {PROTECTED_TIER: WorkerConfig().slo[PROTECTED_TIER], "fast": 10.0}
# the share of a tier's requests within its objective, in every cell
TARGET: dict[str, float] = {PROTECTED_TIER: 0.999, "fast": 0.99}
TIERS = tuple(OBJECTIVE_S)


def _get(outcome: Any, name: str) -> Any:
    return outcome[name] if isinstance(outcome, Mapping) else getattr(outcome, name)


def attainment(outcomes: Iterable[Any], tier: str) -> dict[str, Any]:
    """`tier`'s attainment over `outcomes` (sandbox.loadgen.Outcome, or their asdict()): requests,
    within (answered 200 within the objective), refused (429/503), errors (the rest that got no
    image), attainment (None without requests), its target and whether it was met."""
    mine = [o for o in outcomes if _get(o, "tier") == tier]
    within = sum(_get(o, "status") == 200 and _get(o, "latency") <= OBJECTIVE_S[tier] for o in mine)
    refused = sum(_get(o, "status") in (429, 503) for o in mine)
    share = within / len(mine) if mine else None
    return {
        "requests": len(mine),
        "within": within,
        "refused": refused,
        "errors": sum(_get(o, "status") != 200 for o in mine) - refused,
        "objective_s": OBJECTIVE_S[tier],
        "attainment": share,
        "target": TARGET[tier],
        "met": None if share is None else share >= TARGET[tier],
    }


def attainments(outcomes: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """attainment() of every tier with an objective."""
    outcomes = list(outcomes)
    return {tier: attainment(outcomes, tier) for tier in TIERS}


def pct(a: dict[str, Any] | None) -> str:
    """An attainment as the tables print it: '99.9%', 'none' for a tier without requests, '-' unknown."""
    if a is None:
        return "-"
    return "none" if a["attainment"] is None else f"{a['attainment']:.1%}"


def verdict(cells: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Over {cell: {tier: attainment()}}: per tier the cells that missed, those with no requests,
    and met (None where no cell had requests of the tier)."""
    out: dict[str, Any] = {}
    for tier in TIERS:
        judged = {c: a[tier] for c, a in cells.items() if a.get(tier) and a[tier]["attainment"] is not None}
        missed = sorted(c for c, a in judged.items() if a["attainment"] < TARGET[tier])
        empty = sorted(c for c, a in cells.items() if a.get(tier) and a[tier]["attainment"] is None)
        out[tier] = {
            "target": TARGET[tier],
            "cells": len(judged),
            "missed": missed,
            "no_requests": empty,
            "met": (not missed) if judged else None,
        }
    return out


def verdict_line(v: dict[str, Any]) -> str:
    """The attainment targets, as the reports print them."""
    parts = []
    for tier, x in v.items():
        head = f"{tier} >= {x['target']:.1%} within {OBJECTIVE_S[tier]:g} s"
        if x["met"] is None:
            parts.append(f"{head}: no requests")
            continue
        part = f"{head}: {'met' if x['met'] else 'MISSED'} in {x['cells'] - len(x['missed'])}/{x['cells']} cells"
        part += f" (missed: {', '.join(x['missed'])})" if x["missed"] else ""
        parts.append(part + (f"; no requests in {', '.join(x['no_requests'])}" if x["no_requests"] else ""))
    return "target SLO attainment: " + "; ".join(parts)
