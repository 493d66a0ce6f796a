"""API keys and their budgets (docs/worker.md, "Accounts"): the keys file and budget periods.

The keys file (`worker.keys_file`, TOML) holds one table per key, named for its owner:

    [keys.alice]
    sha256 = "9b71d2..."               # hex SHA-256 of the key; the key itself is never stored
    tiers = ["turbo", "fast", "relax"] # the tiers it may use (default: every tier)
    budget = { turbo = 3600 }          # engine seconds per period and tier (a tier not named: no limit)
    period = "month"                   # when budgets reset (default: worker.budget_period)
    revoked = false

A key is a random token (`new_key`, 256 bits), not a password: one SHA-256 is what a stolen file
must be inverted through, and it keeps checking a key to a microsecond (a slow password hash
would cost every request milliseconds for nothing). HAProxy computes the same hash
(`sha2(256),hex`), so a balancer can check keys against the same file's hashes.

Periods are UTC calendar periods (hour, day, week from Monday, month) or a fixed length
("90s", "15m", "12h", "7d") counted from the Unix epoch: every worker of a fleet agrees on the
period a moment falls in without talking to the others.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .text import quote
from .tiers import PRIORITY_ORDER, TIER_NAMES
from .toml_file import read_toml

KEY_PREFIX = "tn-"  # like OpenAI's "sk-": says what a leaked string is
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # also a metric label and part of a ledger key
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
CALENDAR_PERIODS = ("hour", "day", "week", "month")
DURATION = re.compile(r"^([0-9]{1,9})([smhd])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_PERIOD_S = 366 * 86400
MAX_BUDGET_S = 1e9  # engine seconds: about 32 years of one GPU, more than any period holds
KEY_FIELDS = ("sha256", "tiers", "budget", "period", "revoked")


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key, as the keys file stores it."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


# ---- budget periods ----------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One budget period: an id every worker computes alike, and its bounds (Unix seconds)."""

    id: str
    start: float
    end: float


@dataclass(frozen=True)
class Period:
    spec: str  # a calendar period's name, or a duration such as "90s"

    @property
    def fixed_s(self) -> int | None:
        m = DURATION.match(self.spec)
        return int(m.group(1)) * UNIT_S[m.group(2)] if m else None

    def window(self, t: float) -> Window:
        fixed = self.fixed_s
        if fixed is not None:
            k = int(t // fixed)
            return Window(f"{self.spec}.{k}", k * fixed, (k + 1) * fixed)
        now = dt.datetime.fromtimestamp(t, dt.UTC)
        if self.spec == "hour":
            start = now.replace(minute=0, second=0, microsecond=0)
            end, label = start + dt.timedelta(hours=1), start.strftime("%Y-%m-%dT%H")
        elif self.spec == "day":
            start = now.replace(hour=0, minute=0, second=0, microsecond=0)
            end, label = start + dt.timedelta(days=1), start.strftime("%Y-%m-%d")
        elif self.spec == "week":
            start = (now - dt.timedelta(days=now.weekday())).replace(hour=0, minute=0, second=0, microsecond=0)
            year, week, _ = start.isocalendar()
            end, label = start + dt.timedelta(weeks=1), f"{year}-W{week:02d}"
        else:
            start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            end = (start + dt.timedelta(days=32)).replace(day=1)
            label = start.strftime("%Y-%m")
        return Window(f"{self.spec}.{label}", start.timestamp(), end.timestamp())


def parse_period(value: Any) -> Period:
    """'hour', 'day', 'week', 'month' or a duration ('90s', '15m', '12h', '7d'); ValueError otherwise."""
    if isinstance(value, str) and value in CALENDAR_PERIODS:
        return Period(value)
    m = DURATION.match(value) if isinstance(value, str) else None
    if m is None or not 1 <= int(m.group(1)) * UNIT_S[m.group(2)] <= MAX_PERIOD_S:
        raise ValueError(
            f"expected one of {', '.join(CALENDAR_PERIODS)} or a duration from 1s to 366d "
            f"(e.g. '90s', '15m', '12h', '7d'), got {quote(value)}"
        )
    return Period(value)


# ---- the keys file -----------------------------------------------------------------------


@dataclass(frozen=True)
class Account:
    name: str
    sha256: str
    tiers: tuple[str, ...]  # in priority order
    budget: Mapping[str, float]  # engine seconds per period, by tier; a tier not named has no limit
    period: Period
    revoked: bool = False


@dataclass(frozen=True)
class Keys:
    by_name: Mapping[str, Account]
    by_hash: Mapping[str, Account]

    def __len__(self) -> int:
        return len(self.by_name)


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise ValueError("a key's name is 1-64 letters, digits, '_', '.' or '-' (starting with a letter or digit)")


def _account(name: str, table: Any, default_period: Period) -> Account:
    def bad(field: str, message: str) -> ConfigError:
        return ConfigError(f"keys.{name}.{field}" if field else f"keys.{name}", message)

    try:
        check_name(name)
    except ValueError as exc:
        raise bad("", str(exc)) from None
    if not isinstance(table, dict):
        raise bad("", f"expected a table, got {quote(table)}")
    for field in table:
        if field not in KEY_FIELDS:
            raise bad(field, f"unknown field (known: {', '.join(KEY_FIELDS)})")
    digest = table.get("sha256")
    if not isinstance(digest, str) or not SHA256_HEX.match(digest):
        raise bad("sha256", f"expected the key's SHA-256 as 64 lowercase hex digits, got {quote(digest)}")
    tiers = table.get("tiers", list(TIER_NAMES))
    if not isinstance(tiers, list) or not tiers or any(t not in TIER_NAMES for t in tiers):
        raise bad("tiers", f"expected a non-empty array of tiers from {', '.join(TIER_NAMES)}, got {quote(tiers)}")
    budget = table.get("budget", {})
    if not isinstance(budget, dict):
        raise bad("budget", f"expected a table of engine seconds per tier, got {quote(budget)}")
    for tier, seconds in budget.items():
        if tier not in TIER_NAMES:
            raise bad(f"budget.{tier}", f"unknown tier (expected one of {', '.join(TIER_NAMES)})")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_BUDGET_S:
            raise bad(f"budget.{tier}", f"expected engine seconds from 0 to {MAX_BUDGET_S:g}, got {quote(seconds)}")
    period = default_period
    if "period" in table:
        try:
            period = parse_period(table["period"])
        except ValueError as exc:
            raise bad("period", str(exc)) from None
    revoked = table.get("revoked", False)
    if not isinstance(revoked, bool):
        raise bad("revoked", f"expected true or false, got {quote(revoked)}")
    return Account(
        name,
        digest,
        tuple(t for t in PRIORITY_ORDER if t in tiers),
        {t: float(s) for t, s in budget.items()},
        period,
        revoked,
    )


def parse_keys(data: Mapping[str, Any], default_period: Period) -> Keys:
    """The keys file's tables, validated; ConfigError names the bad field (keys.NAME.FIELD)."""
    for top in data:
        if top != "keys":
            raise ConfigError(top, "unknown table (the keys file holds only [keys.NAME] tables)")
    tables = data.get("keys", {})
    if not isinstance(tables, dict):
        raise ConfigError("keys", f"expected tables [keys.NAME], got {quote(tables)}")
    by_name: dict[str, Account] = {}
    by_hash: dict[str, Account] = {}
    for name, table in tables.items():
        account = _account(name, table, default_period)
        other = by_hash.get(account.sha256)
        if other is not None:
            raise ConfigError(f"keys.{name}.sha256", f"the same key as keys.{other.name}")
        by_name[name] = by_hash[account.sha256] = account
    return Keys(by_name, by_hash)


def load_keys(path: str, default_period: Period) -> Keys:
    """Read and validate the keys file; ConfigError names the file and the bad field."""
    data = read_toml(path)
    try:
        return parse_keys(data, default_period)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.key}", str(exc).removeprefix(f"{exc.key}: ")) from None


def entry(name: str, digest: str, tiers: list[str], budget: Mapping[str, float], period: str | None) -> str:
    """A key's table as TOML text, to append to the keys file (`turboctl keys add`)."""
    lines = [f"[keys.{name}]", f'sha256 = "{digest}"']
    if list(tiers) != list(TIER_NAMES):
        lines.append("tiers = [" + ", ".join(f'"{t}"' for t in tiers) + "]")
    if budget:
        lines.append("budget = { " + ", ".join(f"{t} = {s:g}" for t, s in budget.items()) + " }")
    if period:
        lines.append(f'period = "{period}"')
    return "\n".join(lines) + "\n"
