"""The worker's side of the agent's loop: a thread that keeps an `events` call open on the worker's
control socket (docs/design.md, control protocol), so that a GC pause or a turbo queue-wait
excursion reaches the agent the moment it happens, and the sampling loop never waits on the
worker (whose threads stall behind the very GC pauses being watched).

Each answer carries the GC pauses since the feed's cursor and the per-tier queues; an answer
that names an event also bumps an eventfd the loop polls. A call returns after `period` without
an event, so the feed also reports every `period` that nothing happened. A full `status` comes
every `status_every` for the agent's view. A worker without `events` (an older one) is polled
with `status`. A dead, stuck or restarted worker is a reported state: every call has a timeout,
a failed one is retried after `RETRY_S`, and a restarted worker's pauses are not news.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from turbonode.config import DEFAULT_WORKER
from turbonode.errors import ControlError
from turbonode.jsonrpc import METHOD_NOT_FOUND, ControlClient

log = logging.getLogger("turbonode.agent")

# An events call answers after this long without an event. News is pushed at once whatever its
# length; each quiet answer costs the agent a call and a sample per worker: with 4 workers the
# agent took 2.64 % of a core at 0.25 s, 2.30 % at 1 s (bench/detection.py --workers 4).
FEED_PERIOD_S = 1.0
STATUS_EVERY_S = 1.0  # a full status this often (queues, throttle, step time, backend)
RETRY_S = 0.5  # after a failed call
ANSWER_MARGIN_S = 1.0  # a call still unanswered this long after its wait: the worker is stuck
WAKE_SIGNALS = ("gc_pause_s", "turbo_wait_s")  # the worker's events thresholds, named as the policy's signals


@dataclass
class FeedNews:
    """What the feed learnt since the previous take()."""

    pauses: list[dict[str, Any]] = field(default_factory=list)  # new GC pauses, oldest first
    tiers: dict[str, Any] | None = None  # the latest per-tier queues, if an answer came
    status: dict[str, Any] | None = None  # the latest full status, if one came
    error: str | None = None  # why the worker cannot be read now


class WorkerFeed:
    def __init__(
        self,
        path: str,
        wake_on: dict[str, float] | None = None,
        period: float = FEED_PERIOD_S,
        status_every: float = STATUS_EVERY_S,
        name: str = DEFAULT_WORKER,
    ):
        self.name = name
        self.client = ControlClient(path, timeout=period + ANSWER_MARGIN_S)
        self.wake_on = {k: v for k, v in (wake_on or {}).items() if k in WAKE_SIGNALS}
        self.period, self.status_every = period, status_every
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.pushes = 0  # answers that named an event
        self.has_events = True  # until the worker says it has no such method
        self._cursor: int | None = None
        self._turbo_wait: float | None = None
        self._news = FeedNews()
        self._fresh = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> WorkerFeed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"turbonode-feed-{self.name}", daemon=True)
            self._thread.start()
        return self

    def fresh(self) -> bool:
        """Whether take() has something new: an answer, or a change of error."""
        return self._fresh

    def take(self) -> FeedNews:
        with self._lock:
            news, self._news, self._fresh = self._news, FeedNews(error=self._news.error), False
        return news

    def ack(self) -> None:
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.client.timeout + 1)
            if self._thread.is_alive():  # stuck in a call past its timeout: leave it the fd it may write
                log.warning("worker %s: its feed did not stop within %.1f s", self.name, self.client.timeout + 1)
                return
        os.close(self.efd)

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        status_due = 0.0  # the first call is a status: it sets the cursor
        while not self._stop.is_set():
            full = not self.has_events or time.monotonic() >= status_due
            try:
                if full:
                    answer = self.client.call("status", since_gc_seq=self._cursor)
                    status_due = time.monotonic() + self.status_every
                else:
                    answer = self.client.call("events", **self._events_params())
            except ControlError as exc:
                if exc.code == METHOD_NOT_FOUND and not full:
                    log.info("worker %s has no `events` method (an older worker): polling its status", self.name)
                    self.has_events = False
                    continue
                self._failed(str(exc))
                self._stop.wait(RETRY_S)
                continue
            try:
                event = self._absorb(answer, full)
            except (AttributeError, TypeError, ValueError) as exc:  # a malformed answer is a state, not the end
                self._failed(f"the worker's {'status' if full else 'events'} answer is malformed: {exc}")
                self._stop.wait(RETRY_S)
                continue
            if event:
                self.pushes += 1
                os.eventfd_write(self.efd, 1)
            if not self.has_events:
                self._stop.wait(self.period)

    def _events_params(self) -> dict[str, Any]:
        turbo = self.wake_on.get("turbo_wait_s")
        if turbo is not None and self._turbo_wait is not None and self._turbo_wait > turbo:
            turbo = None  # the excursion is news once: till it ends, answers report it every period
        return {
            "since_gc_seq": self._cursor,
            "gc_pause_s": self.wake_on.get("gc_pause_s"),
            "turbo_wait_s": turbo,
            "timeout_s": self.period,
        }

    def _absorb(self, answer: dict[str, Any], full: bool) -> str | None:
        """Take one answer (status or events) in; returns the event it names, if any."""
        if not isinstance(answer, dict):
            raise TypeError(f"not an object: {str(answer)[:80]!r}")
        gc = answer.get("gc") or {}
        last_seq = gc.get("last_seq")
        if last_seq is not None and (isinstance(last_seq, bool) or not isinstance(last_seq, int)):
            raise TypeError(f"gc.last_seq is not an integer: {str(last_seq)[:40]!r}")
        if self._cursor is None or last_seq is None or last_seq < self._cursor:
            pauses = []  # first contact or a restarted worker: its history is not news
        else:
            pauses = [p for p in gc.get("pauses", []) if p.get("seq", 0) > self._cursor]
        tiers = answer.get("tiers") or {}
        turbo_wait = (tiers.get("turbo") or {}).get("oldest_wait_s")
        if turbo_wait is not None and not isinstance(turbo_wait, (int, float)):
            raise TypeError(f"tiers.turbo.oldest_wait_s is not a number: {str(turbo_wait)[:40]!r}")
        # An event is news once, whichever answer shows it first: a status (periodic, or a polled
        # older worker) that brings a pause or the start of an excursion wakes the loop too, else
        # the events calls after it (whose cursor and excursion state it moved) never would.
        event = answer.get("event") or self._crossed(pauses, turbo_wait)
        self._cursor, self._turbo_wait = last_seq, turbo_wait
        with self._lock:
            if self._news.error is not None:
                log.info("worker %s answers again", self.name)
            self._news.pauses.extend(pauses)
            self._news.tiers = tiers
            if full:
                self._news.status = answer
            self._news.error = None
            self._fresh = True
        return event

    def _crossed(self, pauses: list[dict[str, Any]], turbo_wait: float | None) -> str | None:
        """The event a status answer shows without naming it, by the thresholds `events` is given."""
        gc_limit, wait_limit = self.wake_on.get("gc_pause_s"), self.wake_on.get("turbo_wait_s")
        if gc_limit is not None and any(p.get("pause_s", 0) > gc_limit for p in pauses):
            return "gc_pause"
        was_over = self._turbo_wait is not None and wait_limit is not None and self._turbo_wait > wait_limit
        if wait_limit is not None and turbo_wait is not None and turbo_wait > wait_limit and not was_over:
            return "turbo_wait"
        return None

    def _failed(self, error: str) -> None:
        with self._lock:
            if self._news.error != error:
                self._news.error, self._fresh = error, True
