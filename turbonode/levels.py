"""Degradation levels: what the agent's policy decides, the status shows and the metrics export.

The level's index is its severity (`turbonode_degradation_level`); each level above normal
has its actions in `[policy.actions.<level>]` (docs/design.md).
"""

from __future__ import annotations

LEVELS: tuple[str, ...] = ("normal", "pressured", "degraded", "critical")
NORMAL = 0  # index of the level where nothing is throttled
ACTION_LEVELS: tuple[str, ...] = LEVELS[NORMAL + 1 :]  # the levels that have actions
