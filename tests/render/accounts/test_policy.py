"""Accounts, the pure parts: the keys file, budget periods, which tier a request gets and why,
whose headers are obeyed (turbonode/accounts.py, render/accounts/tier_grant.py, render/accounts/trust.py)."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from render.accounts.keys import MISSING, REVOKED, UNKNOWN, AuthError, KeyRing, bearer
from render.accounts.tier_grant import grant
from render.accounts.trust import TrustedProxies
from turbonode.accounts import Period, entry, hash_key, load_keys, new_key, parse_keys, parse_period
from turbonode.config import load_config
from turbonode.errors import ConfigError
from turbonode.tier_headers import BUDGET, HEADER_IGNORED, NOT_ENTITLED, PAUSED, SHED
from turbonode.tiers import TIER_NAMES

MONTH = Period("month")
ALICE = hash_key("tn-alice")


def utc(*args) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


# ---- periods ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,at,wid,start,end",
    [
        ("hour", utc(2025, 6, 1, 13, 59, 59), "hour.2025-06-01T13", utc(2025, 6, 1, 13), utc(2025, 6, 1, 14)),
        ("day", utc(2025, 12, 31, 23, 0), "day.2025-12-31", utc(2025, 12, 31), utc(2026, 1, 1)),
        ("week", utc(2025, 6, 1, 12), "week.2025-W22", utc(2025, 5, 26), utc(2025, 6, 2)),  # a Sunday
        ("month", utc(2024, 2, 29, 12), "month.2024-02", utc(2024, 2, 1), utc(2024, 3, 1)),
        ("month", utc(2025, 12, 15), "month.2025-12", utc(2025, 12, 1), utc(2026, 1, 1)),
        ("90s", 1000.0, "90s.11", 990.0, 1080.0),
        ("2m", 119.9, "2m.0", 0.0, 120.0),
    ],
)
def test_periods_are_utc_calendar_or_fixed_from_the_epoch(spec, at, wid, start, end):
    w = parse_period(spec).window(at)
    assert (w.id, w.start, w.end) == (wid, start, end)


@pytest.mark.parametrize("bad", ["fortnight", "0s", "90", "1.5h", "367d", 5, "", "-3s"])
def test_a_bad_period_is_refused_with_the_forms_it_takes(bad):
    with pytest.raises(ValueError, match="hour, day, week, month or a duration"):
        parse_period(bad)


# ---- the keys file ---------------------------------------------------------------------------


def test_keys_file_defaults_and_order():
    keys = parse_keys(
        {
            "keys": {
                "alice": {"sha256": ALICE, "tiers": ["relax", "turbo"], "budget": {"turbo": 60}},
                "bob": {"sha256": hash_key("tn-bob"), "period": "day", "revoked": True},
            }
        },
        MONTH,
    )
    alice, bob = keys.by_name["alice"], keys.by_name["bob"]
    assert alice.tiers == ("turbo", "relax") and alice.budget == {"turbo": 60.0} and alice.period == MONTH
    assert bob.tiers == TIER_NAMES and bob.budget == {} and bob.period == Period("day") and bob.revoked
    assert keys.by_hash[ALICE] is alice and len(keys) == 2


@pytest.mark.parametrize(
    "table,key,fragment",
    [
        ({"keys": {"alice": {"sha256": "abc"}}}, "keys.alice.sha256", "64 lowercase hex"),
        ({"keys": {"alice": {"sha256": ALICE, "tiers": ["gold"]}}}, "keys.alice.tiers", "non-empty array"),
        ({"keys": {"alice": {"sha256": ALICE, "tiers": []}}}, "keys.alice.tiers", "non-empty array"),
        ({"keys": {"alice": {"sha256": ALICE, "budget": {"gold": 1}}}}, "keys.alice.budget.gold", "unknown tier"),
        ({"keys": {"alice": {"sha256": ALICE, "budget": {"turbo": -1}}}}, "keys.alice.budget.turbo", "from 0"),
        ({"keys": {"alice": {"sha256": ALICE, "budget": {"turbo": True}}}}, "keys.alice.budget.turbo", "from 0"),
        ({"keys": {"alice": {"sha256": ALICE, "period": "fortnight"}}}, "keys.alice.period", "duration"),
        ({"keys": {"alice": {"sha256": ALICE, "revoked": "yes"}}}, "keys.alice.revoked", "true or false"),
        ({"keys": {"alice": {"sha256": ALICE, "budgets": {}}}}, "keys.alice.budgets", "unknown field"),
        ({"keys": {"a b": {"sha256": ALICE}}}, "keys.a b", "1-64 letters"),
        ({"keys": {"alice": {"sha256": ALICE}, "eve": {"sha256": ALICE}}}, "keys.eve.sha256", "keys.alice"),
        ({"key": {}}, "key", "unknown table"),
    ],
)
def test_a_bad_keys_file_names_the_field(table, key, fragment):
    with pytest.raises(ConfigError) as err:
        parse_keys(table, MONTH)
    assert err.value.key == key and fragment in str(err.value)


def test_load_keys_names_the_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("alice", ALICE, ["turbo", "relax"], {"turbo": 1.5}, "12h"))
    account = load_keys(str(path), MONTH).by_name["alice"]
    assert account.tiers == ("turbo", "relax") and account.budget == {"turbo": 1.5} and account.period == Period("12h")
    path.write_text('[keys.alice]\nsha256 = "nope"\n')
    with pytest.raises(ConfigError, match=rf"^{path}: keys.alice.sha256: "):
        load_keys(str(path), MONTH)
    with pytest.raises(ConfigError, match="file not found"):
        load_keys(str(tmp_path / "absent.toml"), MONTH)


def test_new_keys_are_random_and_hash_like_haproxy():
    a, b = new_key(), new_key()
    assert a != b and a.startswith("tn-") and len(a) > 40
    # HAProxy's `sha2(256),hex,lower` of the same bytes (deploy/haproxy/turbonode.cfg)
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_config_keys_name_what_is_wrong():
    cfg = load_config("/dev/null", env={})
    assert (cfg.worker.keys_file, cfg.worker.ledger, cfg.worker.budget_period) == ("", "embedded", "month")
    for overrides, fragment in [
        ({"worker.trusted_proxies": ["10.0.0.0/33"]}, "worker.trusted_proxies: expected IP addresses"),
        ({"worker.trusted_proxies": "10.0.0.1"}, "worker.trusted_proxies: expected array"),
        ({"worker.ledger": "http://redis:6379"}, "worker.ledger: expected 'embedded' or a Redis URL"),
        ({"worker.budget_period": "fortnight"}, "worker.budget_period: expected one of hour"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config("/dev/null", env={}, overrides=overrides)
    ok = load_config("/dev/null", env={}, overrides={"worker.ledger": "unix:///run/redis.sock"})
    assert ok.worker.ledger == "unix:///run/redis.sock"


# ---- authentication --------------------------------------------------------------------------


def test_bearer_tokens():
    assert bearer("Bearer tn-x") == "tn-x" and bearer("bearer   tn-x ") == "tn-x"
    assert bearer(None) is None and bearer("Basic dXNlcg==") is None and bearer("Bearer ") is None


def test_keyring_refuses_missing_unknown_and_revoked(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(
        entry("alice", ALICE, list(TIER_NAMES), {}, None)
        + f'[keys.bob]\nsha256 = "{hash_key("tn-bob-key")}"\nrevoked = true\n'
    )
    ring = KeyRing(str(path), MONTH)
    assert ring.authenticate("Bearer tn-alice").name == "alice"
    for header, reason in [(None, MISSING), ("Bearer tn-nobody-at-all", UNKNOWN), ("Bearer tn-bob-key", REVOKED)]:
        with pytest.raises(AuthError) as err:
            ring.authenticate(header)
        assert err.value.reason == reason
    with pytest.raises(AuthError) as err:
        ring.authenticate("Bearer tn-nobody-at-all")
    assert "tn-****-all" in str(err.value) and "nobody" not in str(err.value)  # never echoed whole


def test_keyring_reloads_changes_and_keeps_the_last_good_version(tmp_path, caplog):
    now = [0.0]
    path = tmp_path / "keys.toml"
    path.write_text(entry("alice", ALICE, list(TIER_NAMES), {}, None))
    ring = KeyRing(str(path), MONTH, clock=lambda: now[0])
    path.write_text(entry("alice", ALICE, ["relax"], {}, None))
    assert ring.current().by_name["alice"].tiers == TIER_NAMES  # looked at once a second at most
    now[0] = 1.0
    assert ring.current().by_name["alice"].tiers == ("relax",) and ring.reloads == 1
    path.write_text('[keys.alice]\nsha256 = "broken"\n')
    now[0] = 2.0
    with caplog.at_level(logging.ERROR, logger="render.accounts.keys"):
        assert ring.current().by_name["alice"].tiers == ("relax",)
    assert ring.failed_reloads == 1 and "keys.alice.sha256" in caplog.text
    now[0] = 3.0
    ring.current()
    assert ring.failed_reloads == 1  # the same bad version is reported once


# ---- which tier ------------------------------------------------------------------------------

ALL = TIER_NAMES


@pytest.mark.parametrize(
    "args,tier,reason",
    [
        (("turbo", "turbo", ALL), "turbo", ""),
        (("turbo", "turbo", ALL, {"turbo"}), "fast", BUDGET),
        (("turbo", "turbo", ("turbo", "relax"), {"turbo"}), "relax", BUDGET),
        (("turbo", "turbo", ("fast", "relax")), "fast", NOT_ENTITLED),
        (("turbo", "other", ALL), "other", HEADER_IGNORED),
        (("turbo", "other", ("turbo", "relax")), "relax", HEADER_IGNORED),
        (("fast", "fast", ALL, (), {"fast"}), "other", SHED),
        (("fast", "fast", ALL, (), (), {"fast", "other"}), "relax", PAUSED),
        # only the throttle stands in the way: the job table answers (429 shed, or it waits)
        (("fast", "fast", ALL, (), {"fast", "other", "relax"}), "fast", ""),
        (("turbo", "turbo", ("turbo", "relax"), {"turbo"}, {"relax"}), "relax", BUDGET),
        # nothing the key may use and pay for
        (("turbo", "turbo", ("turbo", "fast"), {"turbo", "fast"}), None, BUDGET),
        (("relax", "relax", ("turbo", "fast")), None, NOT_ENTITLED),
    ],
)
def test_grant_walks_down_never_up(args, tier, reason):
    g = grant(*args)
    assert (g.tier, g.reason) == (tier, reason)
    assert g.downgraded == (tier is not None and tier != args[0])


# ---- trusted proxies -------------------------------------------------------------------------


def test_trusted_proxies_match_addresses_and_networks(caplog):
    t = TrustedProxies(["10.0.0.0/24", "127.0.0.2", "fd00::/64"])
    assert t.trusts("10.0.0.7") and t.trusts("127.0.0.2") and t.trusts("fd00::1") and t.trusts("::ffff:10.0.0.9")
    assert not t.trusts("10.0.1.1") and not t.trusts("127.0.0.1") and not t.trusts(None) and not t.trusts("x")
    assert not TrustedProxies([]).trusts("127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="render.accounts.trust"):
        for _ in range(3):
            t.ignored("10.9.9.9", ["X-Turbonode-Tier"])
        t.ignored("10.9.9.8", ["X-Turbonode-Account"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "10.9.9.9" in lines[0] and "X-Turbonode-Account" in lines[1]
