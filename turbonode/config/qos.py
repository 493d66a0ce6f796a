"""[qos]: the egress datapath the agent shapes (tc/, turbonode/qos_params.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..qos_params import check_leaf_limit, check_percent
from .checks import dscp_table, link_rate, opt, per_tier


@dataclass
class QosConfig:
    dev: str = opt("", help="egress interface to shape")
    netns: str = opt("", help="named network namespace of dev ('' = the agent's own)")
    rate: str = opt("1gbit", link_rate, "link rate the HTB root shapes to")
    leaf_limit: int = opt(1000, check_leaf_limit, "packets each leaf queue holds")
    dscp: dict[str, str] = opt({}, dscp_table, "DSCP -> tier overrides on top of the default table")
    rate_pct: dict[str, int] = opt({}, per_tier(check_percent), "guaranteed share per tier, percent of rate")
    ceil_pct: dict[str, int] = opt({}, per_tier(check_percent), "ceiling per tier, percent of rate")
    keep_on_stop: bool = opt(True, help="leave the datapath in place when the agent stops (fail-static)")
