"""`turboctl keys add|list`: the worker's API keys (worker.keys_file; docs/worker.md, "Accounts")
and what each has spent this period (from the worker's ledger: the embedded file or Redis)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import tomllib

import click

from turbonode.accounts import Keys, check_name, entry, hash_key, load_keys, new_key, parse_keys, parse_period
from turbonode.config import WorkerConfig, load_config
from turbonode.errors import ConfigError
from turbonode.tiers import TIER_NAMES

from .params import TIER, TIER_SECONDS, json_option


class PeriodType(click.ParamType):
    name = "period"

    def convert(self, value, param, ctx):
        try:
            parse_period(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return value


def _worker_config(config_file: str | None) -> WorkerConfig:
    try:
        return load_config(config_file).worker
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None


def _keys_file(cfg: WorkerConfig, file: str | None) -> str:
    path = file or cfg.keys_file
    if not path:
        raise click.ClickException("no keys file: pass --file, or set worker.keys_file in the configuration")
    return path


def _load(path: str, cfg: WorkerConfig) -> Keys:
    try:
        return load_keys(path, parse_period(cfg.budget_period))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def file_options(f):
    f = click.option("--file", type=click.Path(dir_okay=False), help="the keys file (default: worker.keys_file)")(f)
    return click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")(f)


@click.group("keys")
def command():
    """The worker's API keys: their tiers, budgets and what they spent."""


@command.command("add")
@click.argument("name")
@click.option("--tier", "tiers", multiple=True, type=TIER, help="a tier it may use (repeatable; default: every tier)")
@click.option("--budget", "budgets", multiple=True, type=TIER_SECONDS, help="TIER=SECONDS of engine time per period")
@click.option("--period", type=PeriodType(), help="when budgets reset: hour, day, week, month or e.g. 12h")
@file_options
@json_option
def add(name, tiers, budgets, period, file, config_file, as_json):
    """Make a key for NAME and append it (hashed) to the keys file; the key is printed once, here.
    A running worker takes it within a second."""
    try:
        check_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    cfg = _worker_config(config_file)
    path = _keys_file(cfg, file)
    old = ""
    if os.path.exists(path):
        _load(path, cfg)  # a broken file is not appended to
        with open(path, encoding="utf-8") as f:
            old = f.read()
    key = new_key()
    text = entry(name, hash_key(key), [t for t in TIER_NAMES if t in tiers] or list(TIER_NAMES), dict(budgets), period)
    try:
        parse_keys(tomllib.loads(old + ("\n" if old and not old.endswith("\n") else "") + text), parse_period("month"))
    except (ConfigError, tomllib.TOMLDecodeError) as exc:
        message = "a key of that name is already in the file" if "twice" in str(exc) else str(exc)
        raise click.ClickException(f"{path}: {message}") from None
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(("\n" if old and not old.endswith("\n") else "") + text)
    if as_json:
        click.echo(json.dumps({"name": name, "key": key, "file": path}))
    else:
        click.echo(f"added {name} to {path}; its key (shown only now):\n{key}")


def _spent(cfg: WorkerConfig, names: list[str], keys: Keys, now: float) -> dict[str, dict[str, float]] | None:
    """Engine seconds per key and tier this period, from the worker's ledger; None if it cannot be read."""
    from render.accounts.ledger import counter
    from render.accounts.ledger_stores import open_store

    wanted = [(n, t, counter(n, t, keys.by_name[n].period.window(now).id)) for n in names for t in TIER_NAMES]
    if cfg.ledger == "embedded" and not os.path.exists(cfg.ledger_file):
        return {n: dict.fromkeys(TIER_NAMES, 0.0) for n in names}  # nothing charged yet

    async def read() -> list[int]:
        store = open_store(cfg.ledger, cfg.ledger_file)
        try:
            return await store.read([c for _, _, c in wanted])
        finally:
            await store.close()

    try:
        values = asyncio.run(read())
    except Exception:  # noqa: BLE001 - the listing goes on without the figures
        return None
    out: dict[str, dict[str, float]] = {n: {} for n in names}
    for (n, t, _), us in zip(wanted, values):
        out[n][t] = us / 1e6
    return out


@command.command("list")
@file_options
@json_option
@click.option(
    "--haproxy-map",
    is_flag=True,
    help="print `SHA256 NAME` per key that is not revoked: the map a balancer checks keys against "
    "(deploy/haproxy/turbonode.cfg)",
)
def list_keys(file, config_file, as_json, haproxy_map):
    """Every key: the tiers it may use, its budgets, and what it spent this period (from the ledger)."""
    cfg = _worker_config(config_file)
    path = _keys_file(cfg, file)
    keys = _load(path, cfg)
    names = sorted(keys.by_name)
    if haproxy_map:
        for n in names:
            if not keys.by_name[n].revoked:
                click.echo(f"{keys.by_name[n].sha256} {n}")
        return
    spent = _spent(cfg, names, keys, time.time())
    rows = []
    for n in names:
        a = keys.by_name[n]
        rows.append(
            {
                "name": n,
                "tiers": list(a.tiers),
                "budget_s": dict(a.budget),
                "period": a.period.spec,
                "revoked": a.revoked,
                "spent_s": spent[n] if spent is not None else None,
            }
        )
    if as_json:
        click.echo(json.dumps({"file": path, "ledger_readable": spent is not None, "keys": rows}, indent=2))
        return
    click.echo(f"{len(rows)} keys in {path}" + ("" if spent is not None else "; the ledger cannot be read now"))
    for r in rows:
        used = r["spent_s"] or {}
        budget = ", ".join(
            f"{t} {used.get(t, 0):.1f}/{r['budget_s'][t]:g} s" if spent is not None else f"{t} {r['budget_s'][t]:g} s"
            for t in r["budget_s"]
        )
        state = " REVOKED" if r["revoked"] else ""
        click.echo(f"  {r['name']}{state}: {','.join(r['tiers'])}; per {r['period']}: {budget or 'no budget'}")
