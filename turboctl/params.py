"""click ParamTypes and options shared by turboctl's commands."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

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


class TierValueType(click.ParamType):
    """TIER=VALUE, e.g. relax=10; `parse` makes the value of VALUE, or None when it is none."""

    def __init__(self, name: str, parse: Callable[[str], Any], what: str):
        self.name, self.parse, self.what = name, parse, what

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        tier, sep, text = value.partition("=")
        parsed = self.parse(text) if sep else None
        if tier not in TIER_NAMES or parsed is None:
            self.fail(
                f"expected {self.name.upper()} with TIER one of {', '.join(TIER_NAMES)} and {self.what}, got {value!r}",
                param,
                ctx,
            )
        return tier, parsed


def _steps(text: str) -> int | None:
    steps = parse_decimal(text)
    return steps if steps is not None and steps >= 1 else None


def _seconds(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if 0 <= seconds < math.inf else None


TIER_STEPS = TierValueType("tier=steps", _steps, "STEPS >= 1")  # a per-tier step cap
TIER_SECONDS = TierValueType("tier=seconds", _seconds, "SECONDS >= 0")  # a per-tier budget of engine time


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="print the answer as JSON")(f)
