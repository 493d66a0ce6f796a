"""Building a Config from the file's tables, the environment (TURBONODE_<SECTION>_<KEY>) and the
flags, in that order of precedence: each value type-checked and checked by its field's `check`
(a ValueError's message prefixed with the dotted key), then what only the whole can check.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ..errors import ConfigError
from ..qos_params import ShareError, check_shares
from ..text import quote
from .file import Config
from .topology import check_weight_ports, check_workers
from .workers import WORKER_NAME

ENV_PREFIX = "TURBONODE_"
# turboctl's own options read these (`render --url`, `--socket` of the worker commands): they
# share the prefix but are no configuration keys.
CLI_ENV_WORKER_URL = "TURBONODE_WORKER_URL"
CLI_ENV_WORKER_SOCKET = "TURBONODE_WORKER_SOCKET"
CLI_ENV_API_KEY = "TURBONODE_API_KEY"  # `turboctl render --api-key`
CLI_ENV_VARS = (CLI_ENV_WORKER_URL, CLI_ENV_WORKER_SOCKET, CLI_ENV_API_KEY)
T = TypeVar("T")
_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "table", list: "array"}


def _typed(key: str, hint: Any, value: Any, where: str = "") -> Any:
    """`value` checked against the field's type hint, element by element inside tables and arrays
    (`where` is the path inside the field); an integer widens to a float."""
    origin = typing.get_origin(hint) or hint
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if origin is not Any and (origin is int and isinstance(value, bool) or not isinstance(value, origin)):
        at = f"{where}: " if where else ""
        raise ConfigError(key, f"{at}expected {_TYPE_NAMES.get(origin, origin.__name__)}, got {quote(value)}")
    args = typing.get_args(hint) or (Any,)
    if isinstance(value, dict):
        return {k: _typed(key, args[-1], v, f"{where}.{k}" if where else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(key, args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _finite(key: str, value: Any, where: str = "") -> None:
    """No float anywhere may be nan or infinite: TOML spells both, and no setting means either.
    (Runs after the field's own check, whose message names the range where it has one.)"""
    if isinstance(value, float) and not math.isfinite(value):
        at = f"{where}: " if where else ""
        raise ConfigError(key, f"{at}must be a finite number, got {value}")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        _finite(key, v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else k)


def _build(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip("."), f"expected a table, got {quote(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # a config dataclass
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        if name not in fields:
            raise ConfigError(key, f"unknown key (known: {', '.join(fields)})")
        typ = hints[name]
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value, key + ".")
            continue
        table = table_of(typ)
        if table is not None:
            kwargs[name] = _build_tables(table, value, key)
            continue
        value = _typed(key, typ, value)
        check = fields[name].metadata.get("check")
        if check:
            try:
                check(value)
            except ValueError as exc:
                raise ConfigError(key, str(exc)) from None
        _finite(key, value)
        kwargs[name] = value
    return cls(**kwargs)


def table_of(hint: Any) -> type | None:
    """The section class of a `dict[str, <section>]` field (one table per name: [workers.<name>])."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict and len(args) == 2 and isinstance(args[1], type):
        return args[1] if dataclasses.is_dataclass(args[1]) else None
    return None


def _build_tables(cls: type[T], data: Any, key: str) -> dict[str, T]:
    if not isinstance(data, Mapping):
        raise ConfigError(key, f"expected a table of tables ([{key}.<name>]), got {quote(data)}")
    out = {}
    for name, table in data.items():
        if not WORKER_NAME.fullmatch(name):
            raise ConfigError(
                f"{key}.{name}", "a name is 1-32 letters, digits, '-' or '_', starting with a letter or digit"
            )
        out[name] = _build(cls, table, f"{key}.{name}.")
    return out


def _check_across(cfg: Config) -> None:
    """What no single key can check: values that must fit together."""
    try:
        check_shares(cfg.qos.rate_pct, cfg.qos.ceil_pct)
    except ShareError as exc:
        raise ConfigError(f"qos.{exc.field}", exc.message) from None
    a = cfg.agent
    if a.throttle_ttl < 2 * a.sample_period:  # renewed at a sample: one late sample must not let it lapse
        raise ConfigError(
            "agent.throttle_ttl",
            f"must be at least twice agent.sample_period ({a.sample_period:g} s), got {a.throttle_ttl:g}",
        )
    check_workers(cfg)
    check_weight_ports(cfg)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for dotted, value in extra.items():
        node: Any = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(dotted, "cannot override inside a non-table value")
        node[leaf] = value
    return out


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    sections = typing.get_type_hints(Config)
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in CLI_ENV_VARS:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        if section not in sections or not key:
            continue
        if table_of(sections[section]) is not None:
            raise ConfigError(name, f"[{section}.<name>] tables are set in the configuration file, not the environment")
        known = [f.name for f in dataclasses.fields(sections[section])]
        if key not in known:
            raise ConfigError(name, f"names no configuration key: {section}.{key} (known: {', '.join(known)})")
        try:  # a TOML literal when it parses as one (numbers, booleans, tables), else a string
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        except RecursionError:
            raise ConfigError(name, "nested too deeply") from None
        out[f"{section}.{key}"] = value
    return out


def build_config(
    data: dict[str, Any], source: str | None, env: Mapping[str, str], overrides: Mapping[str, Any] | None
) -> Config:
    """The file's tables (`data`, read from `source`; None: no file) with the environment's and
    the flags' values over them, built and validated."""
    data = _merge(data, _env_overrides(env))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        cfg = _build(Config, data, "")
    except RecursionError:  # a value nested deep enough to pass tomllib but not the checks
        raise ConfigError(source or "environment", "a value is nested too deeply") from None
    _check_across(cfg)
    return cfg


def as_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
