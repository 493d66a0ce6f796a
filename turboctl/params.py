"""click ParamTypes and options shared by turboctl's commands."""

from __future__ import annotations

import click

from turbonode.errors import RateError
from turbonode.rates import parse_rate
from turbonode.tiers import TIER_NAMES


class RateType(click.ParamType):
    """A rate in tc notation ('100mbit', '1gbit'); converts to bits per second."""

    name = "rate"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_rate(value)
        except RateError as exc:
            self.fail(str(exc), param, ctx)


RATE = RateType()
TIER = click.Choice(TIER_NAMES)


class TierStepsType(click.ParamType):
    """TIER=STEPS, e.g. relax=10 (a per-tier step cap)."""

    name = "tier=steps"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        tier, sep, steps = value.partition("=")
        if not sep or tier not in TIER_NAMES or not steps.isdigit() or int(steps) < 1:
            self.fail(
                f"expected TIER=STEPS with TIER one of {', '.join(TIER_NAMES)} and STEPS >= 1, got {value!r}",
                param,
                ctx,
            )
        return tier, int(steps)


TIER_STEPS = TierStepsType()


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="print the answer as JSON")(f)
