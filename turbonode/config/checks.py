"""The check library of the config fields: each raises ValueError with a message; the loader
names the key (turbonode/config/loader.py). `opt` makes a field of a section dataclass.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from ..cgroups import parse_cpu_list
from ..qos_params import check_link_rate
from ..rates import parse_rate
from ..text import parse_decimal, quote
from ..tiers import TIER_NAMES

MAX_CPUS = 4096  # a CPU quota in CPUs (levers.best_effort_cpus); CPUs are numbered below it
Check = Callable[[Any], object]  # raises ValueError; what it returns is ignored


def positive(v: Any) -> None:
    if v <= 0:
        raise ValueError(f"must be positive, got {v}")


def in_range(lo: float, hi: float, unit: str = "", lo_open: bool = False) -> Check:
    """lo <= v <= hi (lo < v with lo_open); the message shows the range."""

    def check(v: Any) -> None:
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            span = f"more than {_num(lo)} and at most {_num(hi)}" if lo_open else f"between {_num(lo)} and {_num(hi)}"
            raise ValueError(f"must be {span}{unit}, got {_num(v)}")

    return check


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) and not x.is_integer() or abs(x) >= 1e16 else str(int(x))


def all_of(*checks: Check) -> Check:
    def check(v: Any) -> None:
        for c in checks:
            c(v)

    return check


def multiple_of(step: int) -> Check:
    def check(v: Any) -> None:
        if v % step:
            raise ValueError(f"must be a multiple of {step}, got {v}")

    return check


def link_rate(v: Any) -> None:
    check_link_rate(parse_rate(v))  # RateError is a ValueError


def zero_or(inner: Check) -> Check:
    """0 (a default that means "the model's own"), or a value `inner` accepts."""

    def check(v: Any) -> None:
        if v != 0:
            inner(v)

    return check


def empty_or(inner: Check) -> Check:
    """'' (a default that is derived from other keys), or a value `inner` accepts."""

    def check(v: Any) -> None:
        if v != "":
            inner(v)

    return check


def cpu_list(v: Any) -> None:
    parse_cpu_list(v, MAX_CPUS)


def fraction(v: Any) -> None:
    if not 0 <= v <= 1:
        raise ValueError(f"must be between 0 and 1, got {v}")


def one_of(*choices: object) -> Check:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {v!r}")

    return check


def torch_device(v: Any) -> None:
    """auto, cpu, cuda or cuda:N: the devices the worker's backends run on (render/engine/backends)."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", v):
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {quote(v)}")


def host_port(v: Any) -> None:
    host, sep, port = v.rpartition(":")
    number = parse_decimal(port)
    if not sep or number is None or not 0 <= number < 65536:
        raise ValueError(f"expected HOST:PORT, got {quote(v)}")


def split_host_port(address: str) -> tuple[str, int]:
    """'HOST:PORT' (validated by host_port) -> (host, port); '[::1]:80' -> ('::1', 80); no host = all."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def per_tier(inner: Check | None = None) -> Check:
    """A table keyed by tier name; every value checked with `inner`."""

    def check(v: Any) -> None:
        for k, x in v.items():
            if k not in TIER_NAMES:
                raise ValueError(f"unknown tier {k!r} (expected one of {', '.join(TIER_NAMES)})")
            if inner:
                try:
                    inner(x)
                except ValueError as exc:
                    raise ValueError(f"{k}: {exc}") from None

    return check


def dscp_table(v: Any) -> None:
    for k, name in v.items():
        dscp = parse_decimal(k)
        if dscp is None or not 0 <= dscp < 64:
            raise ValueError(f"DSCP key {quote(k)} must be an integer 0..63")
        if name not in TIER_NAMES:
            raise ValueError(f"DSCP {k} maps to unknown tier {quote(name)}")


def opt(default: Any, check: Check | None = None, help: str = "", table_help: Mapping[str, str] | None = None) -> Any:
    """A config field: default, optional check, one-line help (a comment in `config example`;
    `table_help` comments each sub-table of a table of tables)."""
    factory = (lambda d=default: copy.deepcopy(d)) if isinstance(default, (dict, list)) else None
    meta = {"check": check, "help": help, "table_help": table_help or {}}
    if factory:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
