"""Accounts over the real HTTP API (aiohttp on loopback, the tiny model behind it): keys, trusted
proxies, budgets with downgrade and reset, what each answer says about its tier, and the
official `openai` client with an api_key."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from render.accounts import Accounts
from render.accounts.keys import KeyRing
from render.accounts.ledger import Ledger, counter
from render.accounts.ledger_stores import SqliteStore
from render.accounts.trust import TrustedProxies
from tests.helpers import call
from tests.render.helpers import serve
from turbonode.accounts import entry, hash_key, parse_period
from turbonode.tier_headers import (
    ACCOUNT_HEADER,
    BUDGET,
    DOWNGRADED_HEADER,
    HEADER_IGNORED,
    NOT_ENTITLED,
    PAUSED,
    REQUESTED_TIER_HEADER,
    SHED,
    TIER_HEADER,
)
from turbonode.tiers import TIER_NAMES

PERIOD = "4s"  # budgets reset every 4 s here: the reset test waits for one
BALANCER = "127.0.0.2"  # loopback holds 127/8: connecting from here is the trusted balancer

KEYS = {  # name -> (tiers, budget)
    "alice": (TIER_NAMES, {"turbo": 0.001}),  # one turbo job spends it
    "bob": (("fast", "relax"), {}),
    "carol": (("turbo",), {"turbo": 0.001}),
    "erin": (TIER_NAMES, {}),
    "frank": (TIER_NAMES, {}),
    "gina": (("turbo", "relax"), {"turbo": 0.001}),
    "hal": (("turbo", "relax"), {"turbo": 0.001}),
    "jude": (("turbo", "relax"), {"turbo": 0.001}),
    "kim": (("turbo",), {"turbo": 0.001}),
}


def key_of(name: str) -> str:
    return f"tn-test-key-of-{name}"


def write_keys(path, revoked=(), keys=KEYS) -> None:
    kept = {n: v for n, v in keys.items() if n not in revoked}
    text = "".join(entry(n, hash_key(key_of(n)), list(t), b, PERIOD) for n, (t, b) in kept.items())
    for name in revoked:
        text += f'[keys.{name}]\nsha256 = "{hash_key(key_of(name))}"\nrevoked = true\n'
    path.write_text(text)


def keyed(tmp_path, trusted=(BALANCER,)):
    keys = tmp_path / "keys.toml"
    write_keys(keys, revoked=("dave",))
    store = SqliteStore(str(tmp_path / "ledger.sqlite3"), time.time)

    def make(metrics):
        return Accounts(KeyRing(str(keys), parse_period("month")), Ledger(store), TrustedProxies(trusted), metrics)

    return make, keys, store


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    make, keys, store = keyed(tmp_path_factory.mktemp("accounts"))
    with serve(accounts=make, max_batch=4) as s:
        s.keys, s.store = keys, store
        yield s


def render(url, tier=None, key=None, **kw):
    body = {"prompt": "x", "size": "64x64", "steps": 1, **({"tier": tier} if tier else {}), **kw.pop("body", {})}
    return call(url, body=body, key=key, **kw)


def sample(s, name, **labels):
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


def said(headers, body):
    """What an answer says of its tier: the headers, and the job record's fields."""
    meta = body["turbonode"] if "turbonode" in body else body
    return (
        (headers.get(TIER_HEADER), headers.get(REQUESTED_TIER_HEADER), headers.get(DOWNGRADED_HEADER)),
        (meta["tier"], meta["requested_tier"], meta["downgraded"]),
    )


def wait_for_new_period(margin: float = 0.2) -> None:
    """Sleep to just after a budget period begins, so a few requests surely share it."""
    window = parse_period(PERIOD).window(time.time())
    time.sleep(max(0.0, window.end - time.time()) + margin)


# ---- who is asking ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,reason,code,fragment",
    [
        (None, "missing", None, "You didn't provide an API key"),
        ("tn-wrong-key-0000", "unknown", "invalid_api_key", "Incorrect API key provided: tn-****0000"),
        (key_of("dave"), "revoked", "invalid_api_key", "(dave) has been revoked"),
    ],
)
def test_missing_unknown_and_revoked_keys_get_401_in_openai_shape(server, key, reason, code, fragment):
    before = sample(server, "turbonode_worker_auth_failures_total", reason=reason)
    status, headers, body = render(server.url, "turbo", key=key)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code
    assert fragment in body["error"]["message"]
    assert sample(server, "turbonode_worker_auth_failures_total", reason=reason) == before + 1
    # the other routes a client uses want the key too; the health routes do not
    assert call(server.url, "GET", "/v1/models", key=key)[0] == 401
    assert call(server.url, "GET", "/v1/jobs/job-x", key=key)[0] == 401
    assert call(server.url, "GET", "/readyz")[0] == 200


def test_official_openai_client_with_an_api_key(server):
    import openai

    def generate(client, tier):
        return client.images.with_raw_response.generate(
            prompt="a lighthouse", size="64x64", response_format="b64_json", extra_body={"tier": tier, "steps": 1}
        )

    with openai.OpenAI(base_url=server.url + "/v1", api_key=key_of("carol"), max_retries=2) as client:
        assert [m.id for m in client.models.list()] == ["tiny"]
        raw = generate(client, "turbo")
        assert raw.headers[TIER_HEADER] == "turbo" and len(raw.parse().data) == 1
        # carol may use turbo alone, and one job spent its budget: a quota error, not retried
        with pytest.raises(openai.RateLimitError) as err:
            generate(client, "turbo")
        assert err.value.code == "insufficient_quota" and int(err.value.response.headers["Retry-After"]) <= 4
        assert err.value.response.headers["x-should-retry"] == "false"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="tn-not-a-key", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as auth:
            generate(client, "turbo")
        assert auth.value.code == "invalid_api_key"


def test_keys_file_reloaded_while_serving(server):
    newcomer = {"ivy": (("relax",), {})}
    try:
        write_keys(server.keys, revoked=("dave", "erin"), keys={**KEYS, **newcomer})
        time.sleep(1.1)  # the file is looked at once a second at most
        status, headers, body = render(server.url, "turbo", key=key_of("ivy"))
        assert status == 200 and said(headers, body)[0] == ("relax", "turbo", NOT_ENTITLED)
        assert render(server.url, "turbo", key=key_of("erin"))[0] == 401  # revoked while serving
        # a broken edit: the keys before stay in force
        server.keys.write_text("[keys.ivy]\nsha256 = 12\n")
        time.sleep(1.1)
        assert render(server.url, "relax", key=key_of("ivy"))[0] == 200
        assert sample(server, "turbonode_worker_keys_reload_failures_total") >= 1
    finally:
        write_keys(server.keys, revoked=("dave",))
        time.sleep(1.1)
    assert render(server.url, "relax", key=key_of("ivy"))[0] == 401  # gone again
    assert render(server.url, "relax", key=key_of("erin"))[0] == 200


# ---- budgets ---------------------------------------------------------------------------------


def test_budget_spent_runs_as_the_next_tier_and_resets_with_the_period(server):
    wait_for_new_period()
    status, headers, body = render(server.url, "turbo", key=key_of("gina"))
    assert status == 200 and said(headers, body)[0] == ("turbo", None, None)
    used = body["turbonode"]["engine_s"]
    assert used > 0
    # gina may use turbo and relax: turbo's budget spent, she runs as relax and is told why
    status, headers, body = render(server.url, "turbo", key=key_of("gina"))
    assert said(headers, body) == (("relax", "turbo", BUDGET), ("relax", "turbo", BUDGET))
    assert body["turbonode"]["steps"] == 1  # the body's own steps stay; the tier's defaults fill the rest
    wait_for_new_period()
    status, headers, body = render(server.url, "turbo", key=key_of("gina"))
    assert said(headers, body)[0] == ("turbo", None, None)  # a new period: turbo again
    assert sample(server, "turbonode_worker_engine_seconds_total", key="gina", tier="turbo") >= used


def test_every_tier_spent_is_429_until_the_period_resets(server):
    wait_for_new_period()
    assert render(server.url, "turbo", key=key_of("carol"))[0] == 200
    status, headers, body = render(server.url, "turbo", key=key_of("carol"))
    assert status == 429 and body["error"]["code"] == "insufficient_quota"
    assert 1 <= int(headers["Retry-After"]) <= 4
    time.sleep(int(headers["Retry-After"]) + 0.2)
    assert render(server.url, "turbo", key=key_of("carol"))[0] == 200


def test_no_tier_the_key_may_use_is_403(server):
    status, _, body = render(server.url, "turbo", key=key_of("carol"), body={"tier": "relax"})
    assert status == 403 and body["error"]["code"] == "tier_not_allowed"


# ---- telling the client ------------------------------------------------------------------------


def test_every_downgrade_reason_in_headers_body_job_record_and_metrics(server):
    engine, url = server.engine, server.url
    cases = []
    wait_for_new_period()
    render(url, "turbo", key=key_of("hal"))  # spends hal's turbo budget
    cases.append((BUDGET, "turbo", "relax", {"key": key_of("hal")}))
    cases.append((NOT_ENTITLED, "turbo", "fast", {"key": key_of("bob")}))
    # a tier header from outside worker.trusted_proxies: ignored, the default tier serves
    cases.append((HEADER_IGNORED, "turbo", "other", {"key": key_of("frank"), "headers": {TIER_HEADER: "turbo"}}))
    for reason, asked, served, kw in cases:
        before = sample(server, "turbonode_worker_tier_downgrades_total", tier=asked, reason=reason)
        tier = None if reason == HEADER_IGNORED else asked
        status, headers, body = render(url, tier, **kw)
        assert status == 200, body
        assert said(headers, body) == ((served, asked, reason), (served, asked, reason)), reason
        assert sample(server, "turbonode_worker_tier_downgrades_total", tier=asked, reason=reason) == before + 1
    # the throttle sheds or pauses the tier asked for: async jobs, whose record says it too
    for reason, throttle in [(SHED, {"shed_tiers": ["fast"]}), (PAUSED, {"paused_tiers": ["fast"]})]:
        engine.throttle.set(reason="test", ttl_s=30, **throttle)
        try:
            before = sample(server, "turbonode_worker_tier_downgrades_total", tier="fast", reason=reason)
            status, headers, body = render(url, "fast", key=key_of("frank"), body={"async": True})
            assert status == 202 and said(headers, body) == (("other", "fast", reason), ("other", "fast", reason))
            status, headers, record = call(url, "GET", f"/v1/jobs/{body['id']}?wait=30", key=key_of("frank"))
            assert status == 200 and said(headers, record) == (("other", "fast", reason), ("other", "fast", reason))
            assert record["account"] == "frank" and record["engine_s"] > 0
            assert sample(server, "turbonode_worker_tier_downgrades_total", tier="fast", reason=reason) == before + 1
        finally:
            engine.throttle.release()


def test_a_job_is_found_only_by_its_own_key(server):
    engine = server.engine
    engine.throttle.set(paused_tiers=["relax"], reason="keep it queued", ttl_s=30)
    try:
        status, _, body = render(server.url, "relax", key=key_of("erin"), body={"async": True})
        assert status == 202
        job = f"/v1/jobs/{body['id']}"
        assert call(server.url, "GET", job, key=key_of("frank"))[0] == 404
        assert call(server.url, "DELETE", job, key=key_of("frank"))[0] == 404
        assert call(server.url, "GET", job, key=key_of("erin"))[2]["state"] == "queued"  # not cancelled
        assert call(server.url, "DELETE", job, key=key_of("erin"))[2]["state"] == "cancelled"
    finally:
        engine.throttle.release()


# ---- trusted proxies ---------------------------------------------------------------------------


def test_the_balancer_may_name_the_tier_and_the_account(server):
    # from the balancer: its account header stands for the key it checked, its tier header wins
    status, headers, body = render(
        server.url, "relax", headers={ACCOUNT_HEADER: "erin", TIER_HEADER: "fast"}, source=BALANCER
    )
    assert status == 200 and said(headers, body)[0] == ("fast", None, None) and body["turbonode"]["account"] == "erin"
    # an account the worker has no key for: 401
    assert render(server.url, "fast", headers={ACCOUNT_HEADER: "mallory"}, source=BALANCER)[0] == 401
    # the same headers from anyone else are ignored: no key, 401
    before = sample(server, "turbonode_worker_untrusted_headers_total", header=ACCOUNT_HEADER)
    assert render(server.url, "fast", headers={ACCOUNT_HEADER: "erin"})[0] == 401
    assert sample(server, "turbonode_worker_untrusted_headers_total", header=ACCOUNT_HEADER) == before + 1


def test_spoofed_tier_header_on_an_open_worker(caplog):
    """No keys and no trusted proxies: any client may ask for a tier in its body, but a tier header
    is a balancer's word, and nobody here is one: ignored, counted, logged once per address."""
    with serve() as s, caplog.at_level(logging.WARNING, logger="render.accounts.trust"):
        for _ in range(3):
            status, headers, body = render(s.url, headers={TIER_HEADER: "turbo"})
            assert status == 200
            assert said(headers, body) == (("other", "turbo", HEADER_IGNORED), ("other", "turbo", HEADER_IGNORED))
        assert sample(s, "turbonode_worker_untrusted_headers_total", header=TIER_HEADER) == 3
        assert sample(s, "turbonode_worker_tier_downgrades_total", tier="turbo", reason=HEADER_IGNORED) == 3
        # the body's tier is the client's own choice on an open worker; the same header beside it changes nothing
        status, headers, body = render(s.url, "turbo", headers={TIER_HEADER: "turbo"})
        assert said(headers, body)[0] == ("turbo", None, None)
    warnings = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0]


def test_a_trusted_balancer_tier_header_is_obeyed_on_an_open_worker():
    with serve(accounts=lambda m: Accounts(None, None, TrustedProxies([BALANCER]), m)) as s:
        status, headers, body = render(s.url, "relax", headers={TIER_HEADER: "fast"}, source=BALANCER)
        assert said(headers, body)[0] == ("fast", None, None)
        status, _, body = render(s.url, headers={TIER_HEADER: "gold"}, source=BALANCER)
        assert status == 400 and TIER_HEADER in body["error"]["message"]
        # from 127.0.0.1, not the balancer: the body's tier, whatever the header says
        status, headers, body = render(s.url, "relax", headers={TIER_HEADER: "fast"})
        assert said(headers, body)[0] == ("relax", None, None)


def test_ledger_holds_what_the_answers_said(server):
    """Every job's engine seconds, as its answer reported them, reach the key's counter."""
    wait_for_new_period()
    used = [render(server.url, "fast", key=key_of("erin"))[2]["turbonode"]["engine_s"] for _ in range(4)]
    time.sleep(0.2)
    window = parse_period(PERIOD).window(time.time())

    async def read():
        store = SqliteStore(server.store.where, time.time)  # as another worker of the node reads it
        try:
            return await store.read([counter("erin", "fast", window.id)])
        finally:
            await store.close()

    assert asyncio.run(read()) == [sum(round(u * 1e6) for u in used)]


def test_turboctl_render_with_an_api_key(server, tmp_path):
    from click.testing import CliRunner

    from turboctl import main

    def render_cli(name, *more):
        args = ["render", "x", "--tier", "turbo", "--url", server.url, "--size", "64x64", "--steps", "1"]
        return CliRunner().invoke(
            main, [*args, "--out", str(tmp_path / "x.png"), *more], env={"TURBONODE_API_KEY": key_of(name)}
        )

    wait_for_new_period()
    assert render_cli("jude").exit_code == 0
    r = render_cli("jude")
    assert r.exit_code == 0 and "(relax, not turbo: budget," in r.stdout, r.output
    assert render_cli("kim").exit_code == 0
    started = time.monotonic()
    r = render_cli("kim", "--retries", "3")
    assert r.exit_code == 1 and "429" in r.output and "retrying" not in r.output  # a spent budget is not retried
    assert time.monotonic() - started < 3
    r = CliRunner().invoke(main, ["render", "x", "--url", server.url, "--out", str(tmp_path / "y.png")])
    assert r.exit_code == 1 and "401" in r.output and "API key" in r.output
