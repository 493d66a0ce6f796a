"""[policy]: when the agent changes the node's level and what each level does (agent/policy.py);
the rules themselves are in turbonode/config/rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..levels import ACTION_LEVELS
from ..qos_params import check_percent
from ..throttle_params import THROTTLE_KEYS, check_throttle
from .checks import in_range, opt
from .rules import POLICY_RULES, check_dwell, merged_rules, policy_rules, policy_signals

MAX_MIN_CHANGE_INTERVAL_S = 3600.0  # policy.min_change_interval: beyond an hour the policy is frozen
PSI_WINDOW_US = 1_000_000  # the PSI trigger window (agent/watchers/psi.py): a threshold fits in it
ACTION_KEYS = ("relax_ceil_pct", *THROTTLE_KEYS)


def level_actions(v: Any) -> None:
    """Per degradation level, what the agent does: the relax ceil and the worker's throttle, whose
    limits are checked as the worker checks them (turbonode.throttle_params)."""
    for level, acts in v.items():
        if level not in ACTION_LEVELS:
            raise ValueError(f"unknown level {level!r} (expected one of {', '.join(ACTION_LEVELS)})")
        if not isinstance(acts, dict):
            raise ValueError(f"{level}: expected a table, got {acts!r}")
        for k in acts:
            if k not in ACTION_KEYS:
                raise ValueError(f"{level}.{k}: unknown action (known: {', '.join(ACTION_KEYS)})")
        ceil = acts.get("relax_ceil_pct")
        if ceil is not None:
            try:
                check_percent(ceil)
            except ValueError as exc:
                raise ValueError(f"{level}.relax_ceil_pct: {exc}") from None
        try:
            check_throttle(**{k: x for k, x in acts.items() if k in THROTTLE_KEYS})
        except ValueError as exc:
            raise ValueError(f"{level}.{exc}") from None


@dataclass
class PolicyConfig:
    enter_s: float = opt(0.3, check_dwell, "seconds above a rule's enter threshold before escalating (rules' default)")
    exit_s: float = opt(
        3.0, check_dwell, "seconds below a rule's exit threshold before it is healthy again (rules' default)"
    )
    min_change_interval: float = opt(
        1.0, in_range(0, MAX_MIN_CHANGE_INTERVAL_S, " s", lo_open=True), "seconds between two level changes"
    )
    disabled: list[str] = opt([], policy_signals, "signals the policy ignores (still watched and shown)")
    psi_trigger_us: int = opt(
        100000,
        in_range(1, PSI_WINDOW_US, " us"),
        "PSI trigger: stall microseconds per second of its window that wake the sampler at once",
    )
    rules: dict[str, dict[str, Any]] = opt(
        merged_rules({}),
        policy_rules,
        "per signal: enter and exit thresholds; enter_s/exit_s override the dwell; levers it engages while "
        "active; max_level, the highest level it raises the node to (normal: it only engages its levers)",
        table_help={signal: d.help for signal, d in POLICY_RULES.items()},
    )
    actions: dict[str, dict[str, Any]] = opt(
        {
            "pressured": {"relax_ceil_pct": 50, "max_batch": 2},
            "degraded": {"relax_ceil_pct": 25, "max_batch": 2, "paused_tiers": ["relax"], "step_caps": {"fast": 8}},
            "critical": {
                "relax_ceil_pct": 10,
                "max_batch": 1,
                "paused_tiers": ["relax"],
                "step_caps": {"fast": 6},
                "shed_tiers": ["relax"],
                "unready_tiers": ["turbo"],
            },
        },
        level_actions,
        "what each level does (relax_ceil_pct, max_batch, paused_tiers, step_caps, shed_tiers, unready_tiers)",
    )

    def __post_init__(self) -> None:
        self.rules = merged_rules(self.rules)
