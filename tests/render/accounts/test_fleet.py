"""Two real workers (`turboctl worker run`, each with its engine process) sharing one Redis ledger:
the same key charged on both at once, Redis killed by PID mid-run and started again. The
workers keep serving through the outage, keep judging budgets on what they last read plus their
own charges, and once Redis is back it holds every engine second the answers reported: no
update lost, none counted twice."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from render.accounts.ledger import counter
from sandbox.redis_server import REDIS_SKIP, RedisServer
from tests.helpers import call, daemon_env, free_port, readyz, start, stop, turboctl_argv
from tests.render.helpers import metric, scrape
from turbonode.accounts import entry, hash_key, parse_period
from turbonode.tier_headers import BUDGET, DOWNGRADED_HEADER, TIER_HEADER
from turbonode.tiers import TIER_NAMES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(REDIS_SKIP is not None, reason=REDIS_SKIP or "")]
SHARED, TIGHT = "tn-fleet-shared-key", "tn-fleet-tight-key"


def start_worker(tmp_path, name: str, ledger: str, keys) -> tuple:
    port = free_port()
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(
        f'[node]\nname = "{name}"\n[worker]\nlisten = "127.0.0.1:{port}"\ncontrol_socket = "{tmp_path}/{name}.sock"\n'
        f'model = "tiny"\ndevice = "cpu"\nsize = 64\nkeys_file = "{keys}"\nledger = "{ledger}"\n'
    )
    proc, out = start(turboctl_argv("worker", "run", "--config", str(cfg)), daemon_env())
    return proc, out, f"http://127.0.0.1:{port}"


def wait_until(probe, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Clients:
    """A closed-loop client per worker, all with the same key, recording what each answer said."""

    def __init__(self, urls):
        self.answers: list[tuple[int, float]] = []  # (status, engine seconds reported)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(u,), daemon=True) for u in urls]
        for t in self.threads:
            t.start()

    def run(self, url) -> None:
        while not self.stop.is_set():
            status, _, body = call(
                url, body={"prompt": "fleet", "size": "64x64", "steps": 1, "tier": "fast"}, key=SHARED
            )
            with self.lock:
                self.answers.append((status, body["turbonode"]["engine_s"] if status == 200 else 0.0))

    def count(self) -> int:
        with self.lock:
            return len(self.answers)

    def finish(self) -> list[tuple[int, float]]:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        return self.answers


def test_two_workers_one_redis_killed_and_restarted_mid_run(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(
        entry("shared", hash_key(SHARED), list(TIER_NAMES), {}, None)
        + entry("tight", hash_key(TIGHT), ["turbo", "relax"], {"turbo": 0.001}, None)
    )
    with RedisServer() as server:
        workers = [start_worker(tmp_path, f"w{i}", server.url, keys) for i in (1, 2)]
        try:
            for _, out, url in workers:
                wait_until(lambda url=url: readyz(url)[0] == 200, 180, f"{url} ready:\n{out.text}")
            a, b = (url for _, _, url in workers)
            # tight spends its turbo budget on worker a; worker b reads that from Redis
            assert call(a, body={"prompt": "x", "size": "64x64", "steps": 1, "tier": "turbo"}, key=TIGHT)[0] == 200
            time.sleep(0.3)
            status, headers, _ = call(b, body={"prompt": "x", "size": "64x64", "steps": 1, "tier": "turbo"}, key=TIGHT)
            assert (status, headers[TIER_HEADER], headers[DOWNGRADED_HEADER]) == (200, "relax", BUDGET)

            clients = Clients([a, b])
            wait_until(lambda: clients.count() >= 10, 60, "answers before the kill")
            server.kill()
            during = clients.count()
            wait_until(lambda: clients.count() >= during + 10, 60, "answers while Redis is down")
            for url in (a, b):
                text = scrape(url)
                assert metric(text, "turbonode_worker_ledger_up") == 0
                assert metric(text, "turbonode_worker_ledger_unwritten_seconds") > 0
                assert metric(text, "turbonode_worker_ledger_failures_total") >= 1
            # still judged on the last figures read: tight stays downgraded during the outage
            status, headers, _ = call(b, body={"prompt": "x", "size": "64x64", "steps": 1, "tier": "turbo"}, key=TIGHT)
            assert (status, headers[DOWNGRADED_HEADER]) == (200, BUDGET)
            server.start()  # the same port and data (append-only, fsync always)
            after = clients.count()
            wait_until(lambda: clients.count() >= after + 10, 60, "answers after the restart")
            answers = clients.finish()
            for url in (a, b):
                wait_until(lambda url=url: metric(scrape(url), "turbonode_worker_ledger_up") == 1, 30, "ledger up")
                wait_until(
                    lambda url=url: metric(scrape(url), "turbonode_worker_ledger_unwritten_seconds") == 0,
                    30,
                    "charges written",
                )
            assert all(status == 200 for status, _ in answers), [s for s, _ in answers if s != 200]
            window = parse_period("month").window(time.time())
            client = redis.Redis.from_url(server.url)
            stored = int(client.get(counter("shared", "fast", window.id)) or 0)
            client.close()
            assert stored == sum(round(used * 1e6) for _, used in answers)
            assert len(answers) >= 30
        finally:
            for proc, out, _ in workers:
                assert stop(proc) == 0, out.text
        # the log says what happened, once per outage
        for _, out, _ in workers:
            assert out.text.count("unreachable") == 1 and "reachable again" in out.text, out.text


def test_a_worker_refuses_to_start_with_a_bad_keys_file(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nsha256 = "abc"\n')
    proc, out, _ = start_worker(tmp_path, "bad", "embedded", keys)
    assert proc.wait(60) != 0
    assert f"{keys}: keys.alice.sha256" in out.text, out.text
