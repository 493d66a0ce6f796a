"""click ParamTypes shared by turboctl's commands."""

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
