"""The ledger: engine seconds spent per key, tier and budget period (docs/worker.md, "Accounts").

A worker's view of a counter is what the store (render/accounts/ledger_stores.py: Redis shared by the
fleet, or SQLite on one node) said when last read, plus its own charges not yet confirmed
written. A request reads the counters it needs (one MGET); a job's end adds its charge here at
once and wakes the writer, which sends what has gathered as one batch.

When the store cannot be reached the worker keeps serving (as Envoy's rate limit filter does
by default, `failure_mode_deny: false`): keys are still checked (the keys file is local), and
budgets are judged on the last figures it read plus its own charges since, which it keeps
(aggregated per counter: a few bytes per key and tier) and writes, with the same batch ids,
once the store answers again; nothing is lost and nothing counted twice. Meanwhile the store
is not asked for RETRY_S after each failure, so an unreachable Redis costs a request at most
one timeout. What an outage costs: while it lasts, a key may overspend by what the other
workers charge it (each sees only its own), and charges not yet written die with the worker
if it is killed before the store is back. `turbonode_worker_ledger_up` says which state it is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .ledger_stores import LedgerStore

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failure: the store is not read, and the writer waits, this long
CLOSE_TIMEOUT_S = 2.0  # at shutdown: how long the last charges may take to be written
MAX_KNOWN = 100_000  # counters remembered from reads (a fallback only: forgotten beyond)


def counter(name: str, tier: str, period_id: str) -> str:
    """The store's name of a key's counter for a tier in a budget period."""
    return f"turbonode:spent:{name}:{tier}:{period_id}"


@dataclass(frozen=True)
class Batch:
    id: str
    increments: dict[str, int]  # counter -> microseconds
    expires_at: dict[str, float]  # counter -> Unix seconds


class Ledger:
    def __init__(self, store: LedgerStore, retry_s: float = RETRY_S, clock: Callable[[], float] = time.monotonic):
        self.store, self.retry_s, self.clock = store, retry_s, clock
        self.pending: dict[str, int] = {}  # charged, not in a batch yet
        self.expires: dict[str, float] = {}
        self.batch: Batch | None = None  # being written (or retried: the same id)
        self.known: dict[str, int] = {}  # the store's figures as last read or written
        self.up = True  # the last operation on the store succeeded
        self.failures = 0  # operations that failed
        self._retry_at = 0.0
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()  # close: the writer ends after the call it is in
        self._writer: asyncio.Task | None = None

    # ---- reading ---------------------------------------------------------------------

    def _unconfirmed(self, key: str) -> int:
        in_batch = self.batch.increments.get(key, 0) if self.batch is not None else 0
        return self.pending.get(key, 0) + in_batch

    async def spent_us(self, keys: list[str]) -> list[int]:
        """Each counter as this worker knows it: the store's figure (read now, unless the store
        failed less than RETRY_S ago) plus its own charges not yet written."""
        if keys and self.clock() >= self._retry_at:
            try:
                values = await self.store.read(keys)
            except Exception as exc:  # noqa: BLE001 - any store failure: serve from what is known
                self._failed("read", exc)
            else:
                self._ok()
                if len(self.known) > MAX_KNOWN:
                    self.known.clear()
                self.known.update(zip(keys, values))
        return [self.known.get(k, 0) + self._unconfirmed(k) for k in keys]

    @property
    def unwritten_us(self) -> int:
        return sum(self.pending.values()) + (sum(self.batch.increments.values()) if self.batch else 0)

    # ---- charging --------------------------------------------------------------------

    def charge(self, key: str, us: int, expires_at: float) -> None:
        """Add `us` microseconds to a counter (kept until the store has it)."""
        if us <= 0:
            return
        self.pending[key] = self.pending.get(key, 0) + us
        self.expires[key] = max(self.expires.get(key, 0.0), expires_at)
        self._wake.set()

    def start(self) -> None:
        """Run the writer on the running event loop."""
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="turbonode-ledger")

    async def _write_loop(self) -> None:
        while not self._stopping.is_set():
            if self.batch is None and not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue  # a charge, or close
            if not await self.write_once():
                with contextlib.suppress(TimeoutError):  # close ends the wait
                    await asyncio.wait_for(self._stopping.wait(), self.retry_s)

    async def write_once(self) -> bool:
        """Write the batch in flight, or else what is pending; False if the store failed."""
        if self.batch is None:
            if not self.pending:
                return True
            increments, self.pending = self.pending, {}
            self.batch = Batch(uuid.uuid4().hex, increments, {k: self.expires.pop(k) for k in increments})
        batch = self.batch
        try:
            await self.store.add(batch.id, batch.increments, batch.expires_at)
        except Exception as exc:  # noqa: BLE001 - kept, and sent again with the same id
            self._failed("write", exc)
            return False
        for key, us in batch.increments.items():
            if key in self.known:
                self.known[key] += us
        self.batch = None
        self._ok()
        return True

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the writer; try to write what is left (for `timeout` at most), then let the store go."""
        if self._writer is not None:
            # Asked to stop, not cancelled: a store call cancelled between its request and its
            # answer may leave the client's connection in a state no later call gets out of
            # (redis-py's asyncio client has had several), and a cancellation the client turns
            # into its own error would read as a store failure and keep this loop going (what
            # tests/render/accounts/test_ledger.py's chargers, hung idle at their end twice in CI, are
            # read as). The call in flight is bounded by the store's own timeout.
            self._stopping.set()
            self._wake.set()
            if not (await asyncio.wait({self._writer}, timeout=timeout))[0]:
                self._writer.cancel()  # past the timeout all the same: not waited for
            self._writer = None
        deadline = self.clock() + timeout
        while (self.batch is not None or self.pending) and self.clock() < deadline:
            if not await self.write_once():
                await asyncio.sleep(min(0.1, self.retry_s))
        if self.batch is not None or self.pending:
            log.error(
                "ledger %s: %.3f engine seconds of charges could not be written before the worker stopped",
                self.store.where,
                self.unwritten_us / 1e6,
            )
        await self.store.close()

    # ---- the store's health --------------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self._retry_at = self.clock() + self.retry_s
        if self.up:
            log.error(
                "ledger %s unreachable (%s failed: %s): serving on the figures last read plus this worker's "
                "own charges, which are kept and written once it answers",
                self.store.where,
                what,
                f"{type(exc).__name__}: {exc}",
            )
        self.up = False

    def _ok(self) -> None:
        if not self.up:
            log.warning("ledger %s reachable again", self.store.where)
        self.up = True
