"""The ledger against a real Redis (started here, killed by PID) and the embedded SQLite file:
batches counted once, no update lost between workers, charges kept while Redis is down."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis

from render.accounts.ledger import Ledger, counter
from render.accounts.ledger_stores import RedisStore, SqliteStore
from sandbox.redis_server import REDIS_SKIP, RedisServer
from tests.helpers import ROOT

needs_redis = pytest.mark.skipif(REDIS_SKIP is not None, reason=REDIS_SKIP or "")
KEY = counter("alice", "turbo", "month.2025-06")
LATER = time.time() + 3600


@pytest.fixture
def redis_server():
    if REDIS_SKIP:
        pytest.skip(REDIS_SKIP)
    with RedisServer() as server:
        yield server


def make_store(kind: str, tmp_path, server=None):
    return RedisStore(server.url) if kind == "redis" else SqliteStore(str(tmp_path / "ledger.sqlite3"), time.time)


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_a_batch_counts_once_however_often_it_is_sent(kind, tmp_path, request):
    server = request.getfixturevalue("redis_server") if kind == "redis" else None

    async def run():
        store = make_store(kind, tmp_path, server)
        try:
            await store.add("batch-1", {KEY: 1500}, {KEY: LATER})
            await store.add("batch-1", {KEY: 1500}, {KEY: LATER})  # its answer was lost: sent again
            await store.add("batch-2", {KEY: 25}, {KEY: LATER})
            return await store.read([KEY, counter("bob", "turbo", "x")])
        finally:
            await store.close()

    assert asyncio.run(run()) == [1525, 0]


@needs_redis
def test_redis_counters_expire_a_period_after_their_own():
    with RedisServer(unix_socket=True) as server:  # the unix:// form of worker.ledger

        async def run():
            store = RedisStore(server.url)
            try:
                await store.add("b", {KEY: 7}, {KEY: time.time() + 100})
            finally:
                await store.close()

        asyncio.run(run())
        client = redis.Redis(unix_socket_path=str(server.unix))
        assert int(client.get(KEY)) == 7 and 90 < client.ttl(KEY) <= 100
        client.close()


CHARGER = textwrap.dedent(
    """
    import asyncio, faulthandler, json, random, sys, threading, time
    faulthandler.dump_traceback_later(90, exit=True)  # a hang (twice in CI, 2026-12-05) leaves its stacks
    from render.accounts.ledger import Ledger
    from render.accounts.ledger_stores import RedisStore, SqliteStore
    kind, where, key, n, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    rng = random.Random(seed)

    def tasks_stacks():  # where each task awaits (the await chain): the threads show only the idle loop
        for task in asyncio.all_tasks():
            print(f"task {task.get_name()}:", file=sys.stderr)
            coro = task.get_coro()
            while coro is not None:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    print(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=sys.stderr)
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)

    async def main():
        watchdog = threading.Timer(80, asyncio.get_running_loop().call_soon_threadsafe, (tasks_stacks,))
        watchdog.daemon = True
        watchdog.start()
        store = RedisStore(where) if kind == "redis" else SqliteStore(where, time.time)
        ledger = Ledger(store, retry_s=0.01)
        ledger.start()
        total = 0
        for _ in range(n):
            us = rng.randrange(1, 100_000)
            total += us
            ledger.charge(key, us, time.time() + 3600)
            await asyncio.sleep(0)  # let the writer send what has gathered, as job ends arrive
        await ledger.close(timeout=30)
        print(json.dumps({"charged": total, "unwritten": ledger.unwritten_us}))

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_two_workers_charging_one_key_lose_no_update(kind, tmp_path, request):
    """Two processes (two workers' fronts) charge the same counter at once: the store's total is
    the sum of both, to the microsecond (Redis: INCRBY in one script; SQLite: one transaction)."""
    server = request.getfixturevalue("redis_server") if kind == "redis" else None
    where = server.url if server else str(tmp_path / "ledger.sqlite3")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHARGER, kind, where, KEY, "2000", str(seed)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    done = [p.communicate(timeout=120) for p in procs]
    if any(p.returncode != 0 for p in procs):  # whole: an assertion's message is cut short
        pytest.fail("\n".join(f"charger exit {p.returncode}:\n{err[-8000:]}" for p, (_, err) in zip(procs, done)))
    outs = [json.loads(out) for out, _ in done]
    assert all(o["unwritten"] == 0 for o in outs)

    async def total():
        store = make_store(kind, tmp_path, server)
        try:
            return (await store.read([KEY]))[0]
        finally:
            await store.close()

    assert asyncio.run(total()) == sum(o["charged"] for o in outs)


def test_a_worker_opening_the_embedded_ledger_waits_for_anothers_write(tmp_path):
    """A node's workers start together: one opening the file while another holds its write lock
    waits for it instead of failing to start (seen as 'database is locked' under load)."""
    path = str(tmp_path / "ledger.sqlite3")
    asyncio.run(SqliteStore(path, time.time).close())  # the file exists, as after a first start
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        store = SqliteStore(path, time.time)
    finally:
        release.join()
        holder.close()

    async def charge_and_read():
        await store.add("b1", {KEY: 5}, {KEY: time.time() + 100})
        value = (await store.read([KEY]))[0]
        await store.close()
        return value

    assert asyncio.run(charge_and_read()) == 5


@needs_redis
def test_charges_made_while_redis_is_down_are_written_when_it_is_back(redis_server):
    async def run():
        ledger = Ledger(RedisStore(redis_server.url), retry_s=0.2)
        try:
            ledger.charge(KEY, 1_000_000, LATER)
            assert await ledger.write_once() and ledger.up
            assert await ledger.spent_us([KEY]) == [1_000_000]
            redis_server.kill()
            ledger.charge(KEY, 250_000, LATER)
            assert not await ledger.write_once() and not ledger.up and ledger.failures == 1
            # served from the figure last read plus its own unwritten charges, without asking
            started = time.monotonic()
            assert await ledger.spent_us([KEY]) == [1_250_000]
            assert time.monotonic() - started < 0.05
            ledger.charge(KEY, 5, LATER)  # gathered apart from the batch being retried
            assert ledger.unwritten_us == 250_005
            redis_server.start()  # the same port and data (append-only)
            assert await ledger.write_once() and await ledger.write_once() and ledger.up
            assert ledger.unwritten_us == 0
            await asyncio.sleep(0.2)
            return await ledger.spent_us([KEY])
        finally:
            await ledger.close()

    assert asyncio.run(run()) == [1_250_005]
    client = redis.Redis.from_url(redis_server.url)
    assert int(client.get(KEY)) == 1_250_005  # nothing lost, nothing counted twice
    client.close()


def test_an_unreachable_store_is_not_asked_again_for_a_while(tmp_path):
    from sandbox.redis_server import free_port

    async def run():
        ledger = Ledger(RedisStore(f"redis://127.0.0.1:{free_port()}/0"), retry_s=30)
        try:
            ledger.charge(KEY, 42, LATER)
            assert await ledger.spent_us([KEY]) == [42] and not ledger.up
            failures = ledger.failures
            for _ in range(100):
                assert await ledger.spent_us([KEY]) == [42]
            return ledger.failures - failures
        finally:
            await ledger.close(timeout=0.1)

    assert asyncio.run(run()) == 0


class CancelIntoErrorStore:
    """A store whose client turns a cancellation in mid-call into an error of its own, as a
    network client may when its connection is torn down under it."""

    where = "a store that turns a cancel into an error"

    def __init__(self):
        self.written: list[dict[str, int]] = []
        self.in_call = asyncio.Event()

    async def read(self, keys):
        return [0] * len(keys)

    async def add(self, batch_id, increments, expires_at):
        self.in_call.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            raise ConnectionError("connection reset while cancelled") from None
        self.written.append(dict(increments))

    async def close(self):
        pass


def test_close_lets_the_call_in_flight_finish_and_ends_the_writer():
    """close asks the writer to stop rather than cancelling its store call: with a client that
    turns a cancel into an error, the cancelled writer took it for a store failure, wrote again
    and waited for charges for good, and close never returned."""

    async def run():
        store = CancelIntoErrorStore()
        ledger = Ledger(store, retry_s=0.01)
        ledger.start()
        ledger.charge(KEY, 42, LATER)
        await store.in_call.wait()
        await asyncio.wait_for(ledger.close(timeout=1.0), 5)
        return store.written, ledger.unwritten_us, ledger.failures

    assert asyncio.run(run()) == ([{KEY: 42}], 0, 0)


def test_a_ledger_that_cannot_be_used_names_the_key(tmp_path):
    from render.accounts.ledger_stores import open_store
    from turbonode.errors import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"^worker.ledger_file: cannot open"):
        open_store("embedded", str(blocker / "ledger.sqlite3"))
    with pytest.raises(ConfigError, match=r"^worker.ledger: redis://h:port/0: Port"):
        open_store("redis://h:port/0", "")
