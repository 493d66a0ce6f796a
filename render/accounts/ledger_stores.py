"""Where the ledger's counters live (render/accounts/ledger.py): Redis for a fleet, SQLite for one node.

Counters are integer microseconds of engine time, one per key, tier and budget period, each
expiring a period after its own ends. A write is a batch of increments with an id, applied
at most once: a batch whose answer was lost (the connection dropped after Redis ran it) is sent
again with the same id and skipped where it already counted, so a retry neither loses nor
doubles a charge. In Redis the batch is one Lua script (atomic, like INCRBY itself: two workers
charging one key lose no update); in SQLite one transaction (WAL: the node's workers share the file).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Mapping
from typing import Protocol

from turbonode.errors import ConfigError

APPLIED_TTL_S = 86400  # how long a batch id is remembered: far longer than any retry takes
PURGE_EVERY = 1000  # SQLite: expired rows are deleted at start and every this many batches
# SQLite waits for another worker's lock: long while opening (a node's workers start together, and
# a worker that gives up fails to start), short per batch (on the event loop; the ledger retries).
OPEN_BUSY_S = 10.0
BATCH_BUSY_MS = 100


class LedgerStore(Protocol):
    where: str  # what logs and errors name

    async def read(self, keys: list[str]) -> list[int]: ...

    async def add(self, batch_id: str, increments: Mapping[str, int], expires_at: Mapping[str, float]) -> None: ...

    async def close(self) -> None: ...


# KEYS[1]: the batch's marker; KEYS[2..n]: counters; ARGV[1]: the marker's ttl; then per counter
# its increment (microseconds) and the Unix second it expires at.
ADD_SCRIPT = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 2, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[2 * i - 2])
  redis.call('EXPIREAT', KEYS[i], ARGV[2 * i - 1])
end
return 1
"""


class RedisStore:
    """redis-py's asyncio client, without its retries (the ledger retries, with the same batch id)
    and with short timeouts: an unreachable Redis costs a request at most one timeout, after
    which the ledger stops asking for a while (render/accounts/ledger.py)."""

    def __init__(self, url: str, timeout_s: float = 0.25):
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.where = _without_password(url)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._add = self.client.register_script(ADD_SCRIPT)

    async def read(self, keys: list[str]) -> list[int]:
        return [int(v or 0) for v in await self.client.mget(keys)]

    async def add(self, batch_id: str, increments: Mapping[str, int], expires_at: Mapping[str, float]) -> None:
        names = list(increments)
        args: list[int] = [APPLIED_TTL_S]
        for name in names:
            args += [increments[name], int(expires_at[name])]
        await self._add(keys=[f"turbonode:batch:{batch_id}", *names], args=args)

    async def close(self) -> None:
        await self.client.aclose()


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{creds.split(':')[0]}:***@{host}" if at and ":" in creds else url


class SqliteStore:
    """The embedded ledger: one SQLite file in WAL mode, shared by the workers of a node. Each
    call is a few tens of microseconds on a local disk, so it runs on the event loop."""

    def __init__(self, path: str, now):
        self.where = path
        self.now = now  # Unix seconds, for expiry
        os.makedirs(os.path.dirname(path) or ".", mode=0o750, exist_ok=True)
        self.db = sqlite3.connect(path, timeout=OPEN_BUSY_S, isolation_level=None, check_same_thread=False)
        deadline = time.monotonic() + OPEN_BUSY_S
        while True:
            try:
                self._set_up()
                break
            except sqlite3.OperationalError as exc:
                # Switching a new file to WAL answers "locked" at once, without the busy wait,
                # while another worker's connection sets it up: try again until it has.
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.db.execute(f"PRAGMA busy_timeout={BATCH_BUSY_MS}")
        self._batches = 0

    def _set_up(self) -> None:
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a crash of the process
        self.db.execute("CREATE TABLE IF NOT EXISTS spent (key TEXT PRIMARY KEY, us INTEGER NOT NULL, expires REAL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS applied (id TEXT PRIMARY KEY, expires REAL)")
        self._purge()

    def _purge(self) -> None:
        with self.db:
            self.db.execute("DELETE FROM spent WHERE expires < ?", (self.now(),))
            self.db.execute("DELETE FROM applied WHERE expires < ?", (self.now(),))

    async def read(self, keys: list[str]) -> list[int]:
        marks = ",".join("?" * len(keys))
        rows = dict(self.db.execute(f"SELECT key, us FROM spent WHERE key IN ({marks})", keys).fetchall())
        return [int(rows.get(k, 0)) for k in keys]

    async def add(self, batch_id: str, increments: Mapping[str, int], expires_at: Mapping[str, float]) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            fresh = db.execute(
                "INSERT OR IGNORE INTO applied (id, expires) VALUES (?, ?)", (batch_id, self.now() + APPLIED_TTL_S)
            ).rowcount
            if fresh:
                db.executemany(
                    "INSERT INTO spent (key, us, expires) VALUES (?, ?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET us = us + excluded.us, expires = excluded.expires",
                    [(k, us, expires_at[k]) for k, us in increments.items()],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._batches += 1
        if self._batches % PURGE_EVERY == 0:
            self._purge()

    async def close(self) -> None:
        self.db.close()


def open_store(ledger: str, ledger_file: str) -> LedgerStore:
    """worker.ledger's store: 'embedded' (worker.ledger_file) or a Redis URL. ConfigError names the
    key when the file cannot be opened or the URL not used; an unreachable Redis is no error here
    (render/accounts/ledger.py: the worker serves on)."""
    if ledger == "embedded":
        try:
            return SqliteStore(ledger_file, time.time)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError("worker.ledger_file", f"cannot open {ledger_file}: {exc}") from None
    try:
        return RedisStore(ledger)
    except ValueError as exc:
        raise ConfigError("worker.ledger", f"{_without_password(ledger)}: {exc}") from None
