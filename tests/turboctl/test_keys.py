"""`turboctl keys add|list` (CliRunner) and the doctor's check of the keys."""

from __future__ import annotations

import asyncio
import json
import time

from click.testing import CliRunner

from render.accounts.keys import KeyRing
from render.accounts.ledger import counter
from render.accounts.ledger_stores import SqliteStore
from sandbox.redis_server import free_port
from turboctl import main
from turboctl.doctor import FAIL, OK, WARN, check_keys
from turbonode.accounts import parse_period
from turbonode.config import WorkerConfig


def config(tmp_path, **worker) -> str:
    path = tmp_path / "turbonode.toml"
    worker.setdefault("ledger_file", str(tmp_path / "ledger.sqlite3"))
    path.write_text("[worker]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in worker.items()))
    return str(path)


def test_add_writes_the_hash_and_prints_the_key_once(tmp_path):
    keys = tmp_path / "keys.toml"
    cfg = config(tmp_path, keys_file=str(keys))
    runner = CliRunner()
    r = runner.invoke(
        main,
        ["keys", "add", "alice", "--tier", "relax", "--tier", "turbo", "--budget", "turbo=3600", "--period", "day"]
        + ["--config", cfg, "--json"],
    )
    assert r.exit_code == 0, r.output
    key = json.loads(r.output)["key"]
    assert key.startswith("tn-") and key not in keys.read_text()
    account = KeyRing(str(keys), parse_period("month")).authenticate(f"Bearer {key}")
    assert (account.name, account.tiers, account.budget, account.period.spec) == (
        "alice",
        ("turbo", "relax"),
        {"turbo": 3600.0},
        "day",
    )
    r = runner.invoke(main, ["keys", "add", "alice", "--config", cfg])
    assert r.exit_code == 1 and "already in the file" in r.output
    r = runner.invoke(main, ["keys", "add", "bob", "--budget", "gold=1", "--config", cfg])
    assert r.exit_code == 2 and "TIER=SECONDS" in r.output
    r = runner.invoke(main, ["keys", "add", "bad name", "--config", cfg])
    assert r.exit_code == 2 and "1-64 letters" in r.output
    r = runner.invoke(main, ["keys", "add", "bob", "--config", config(tmp_path)])
    assert r.exit_code == 1 and "no keys file" in r.output


def test_list_shows_budgets_and_what_was_spent(tmp_path):
    keys = tmp_path / "keys.toml"
    cfg = config(tmp_path, keys_file=str(keys))
    runner = CliRunner()
    for args in (["alice", "--budget", "turbo=60"], ["bob", "--tier", "relax"]):
        assert runner.invoke(main, ["keys", "add", *args, "--config", cfg]).exit_code == 0
    window = parse_period("month").window(time.time())

    async def charge():
        store = SqliteStore(str(tmp_path / "ledger.sqlite3"), time.time)
        turbo = counter("alice", "turbo", window.id)
        await store.add("b1", {turbo: 12_500_000}, {turbo: window.end})
        await store.close()

    asyncio.run(charge())
    r = runner.invoke(main, ["keys", "list", "--config", cfg, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    alice = next(k for k in out["keys"] if k["name"] == "alice")
    assert out["ledger_readable"] and alice["spent_s"]["turbo"] == 12.5 and alice["budget_s"] == {"turbo": 60.0}
    r = runner.invoke(main, ["keys", "list", "--config", cfg])
    assert "alice: turbo,fast,other,relax; per month: turbo 12.5/60 s" in r.output
    assert "bob: relax; per month: no budget" in r.output
    # a Redis ledger that does not answer: the keys are listed all the same
    down = config(tmp_path, keys_file=str(keys), ledger=f"redis://127.0.0.1:{free_port()}/0")
    r = runner.invoke(main, ["keys", "list", "--config", down])
    assert r.exit_code == 0 and "the ledger cannot be read now" in r.output and "turbo 60 s" in r.output


def test_doctor_warns_that_anyone_can_claim_turbo_without_keys(tmp_path):
    c = check_keys(WorkerConfig())
    assert c.status == WARN and "can claim turbo" in c.detail and "turboctl keys add" in c.fix
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nsha256 = "x"\n')
    c = check_keys(WorkerConfig(keys_file=str(keys)))
    assert c.status == FAIL and "keys.alice.sha256" in c.detail
    keys.write_text(f'[keys.alice]\nsha256 = "{"0" * 64}"\nrevoked = true\n')
    c = check_keys(WorkerConfig(keys_file=str(keys)))
    assert c.status == OK and "1 keys (1 revoked)" in c.detail
    c = check_keys(WorkerConfig(keys_file=str(keys), trusted_proxies=["0.0.0.0/0"]))
    assert c.status == WARN and "trusts every address" in c.detail

    def refused(url):
        raise ConnectionRefusedError(111, "Connection refused")

    c = check_keys(WorkerConfig(keys_file=str(keys), ledger="redis://10.0.0.9:6379/0"), ping=refused)
    assert c.status == WARN and "Redis does not answer" in c.detail
    assert check_keys(WorkerConfig(keys_file=str(keys), ledger="redis://x/0"), ping=lambda url: None).status == OK


def test_config_check_validates_the_keys_file(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nsha256 = "abc"\n')
    r = CliRunner().invoke(main, ["config", "check", config(tmp_path, keys_file=str(keys))])
    assert r.exit_code == 1 and f"{keys}: keys.alice.sha256" in r.output
    keys.write_text(f'[keys.alice]\nsha256 = "{"0" * 64}"\n')
    assert CliRunner().invoke(main, ["config", "check", config(tmp_path, keys_file=str(keys))]).exit_code == 0
