"""click ParamTypes and options shared by turboctl's commands."""

from __future__ import annotations

import click

from turbonode.qos_params import check_link_rate, check_rate
from turbonode.rates import parse_rate
from turbonode.text import parse_decimal
from turbonode.tiers import TIER_NAMES


class RateType(click.ParamType):
    """A rate in tc notation ('100mbit', '1gbit') within what the datapath takes; bits per second."""

    name = "rate"

    def __init__(self, check=check_rate):
        self.check = check  # turbonode.qos_params: a class's rate, or the link's

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return self.check(parse_rate(value))
        except ValueError as exc:  # RateError is one
            self.fail(str(exc), param, ctx)


RATE = RateType()
LINK_RATE = RateType(check_link_rate)
TIER = click.Choice(TIER_NAMES)


class TierStepsType(click.ParamType):
    """TIER=STEPS, e.g. relax=10 (a per-tier step cap)."""

    name = "tier=steps"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        tier, sep, text = value.partition("=")
        steps = parse_decimal(text)
        if not sep or tier not in TIER_NAMES or steps is None or steps < 1:
            self.fail(
                f"expected TIER=STEPS with TIER one of {', '.join(TIER_NAMES)} and STEPS >= 1, got {value!r}",
                param,
                ctx,
            )
        return tier, steps


TIER_STEPS = TierStepsType()


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="print the answer as JSON")(f)
