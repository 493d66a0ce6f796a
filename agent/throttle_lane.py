"""One worker's throttle, kept by a thread of its own.

The sampling loop says what it wants for the worker (`want`: the level's throttle with the
levers' fields, or None); the lane's thread makes the worker match: it sends the throttle,
renews the lease every third of its TTL while it is wanted, and releases it when it is not. A
worker that is slow to answer (wedged, stalled behind its own GC, restarting, still loading)
holds only its own lane, for at most the client's timeout: never the loop, never another
worker's throttle. A dead agent's throttle lapses at the worker, lane by lane.

An operator's hold on the worker (`turboctl throttle --hold`) is respected: the worker refuses
our throttle and release with THROTTLE_HELD, and the lane keeps its hands off (asking again every
renew interval) until the hold is released or expires; the hold is shown in the status.

`step(now)` is one turn of the thread, callable directly with a fake clock (tests); the thread
runs it on time.monotonic() whenever something is due.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from typing import Any

from turbonode.errors import ControlError
from turbonode.jsonrpc import ControlClient
from turbonode.throttle_params import THROTTLE_HELD

log = logging.getLogger("turbonode.agent")

RENEW_FRACTION = 1 / 3  # renew after a third of the TTL: two more tries before it expires


class ThrottleLane:
    def __init__(
        self, name: str, client: ControlClient | None, ttl_s: float, dry_run: bool = False, retry_s: float = 0.1
    ):
        self.name, self.client, self.ttl_s, self.dry_run, self.retry_s = name, client, ttl_s, dry_run, retry_s
        self.counts: Counter = Counter()  # (action, signal) -> n
        self.error: str | None = None
        self.hold: dict | None = None  # the operator's hold in force at the worker, as it told us
        self._want: dict | None = None
        self._reason, self._signal = "", ""
        self._sent: dict | None = None  # the throttle in force at the worker, as far as we know
        self._sent_at = -math.inf
        self._tried_at = -math.inf  # the last call that failed or met a hold
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- the loop's side -------------------------------------------------------------

    def want(self, throttle: dict | None, reason: str, signal: str) -> None:
        """What the worker should have: `reason` goes to the worker, `signal` labels the metrics."""
        with self._cond:
            changed = throttle != self._want
            self._want, self._reason, self._signal = throttle, reason, signal
            if changed:
                self._tried_at = -math.inf  # a new decision is tried at once, not after a retry delay
                self._cond.notify()

    def start(self) -> ThrottleLane:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"turbonode-throttle-{self.name}", daemon=True)
            self._thread.start()
        return self

    def close(self, deadline: float) -> None:
        """Stop the thread once what is wanted (a release, at shutdown: `want(None, ...)` every
        lane first, so that they release at once) has reached the worker, or at `deadline`
        (time.monotonic()) at the latest."""
        if self._thread is not None:
            with self._cond:
                while self._thread.is_alive() and self._pending() and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, min(0.05, deadline - time.monotonic())))
                self._stop = True
                self._cond.notify()
            self._thread.join(max(0.0, deadline - time.monotonic()))
        else:
            self.step(time.monotonic())

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {"sent": self._sent, "error": self.error, "hold": self.hold}

    def counted(self) -> Counter:
        with self._cond:
            return Counter(self.counts)

    # ---- the lane's side ---------------------------------------------------------------

    def _pending(self) -> bool:
        """A release or throttle not yet at the worker (a hold counts as done: it is the operator's)."""
        return self._want != self._sent and self.hold is None

    def due_in(self, now: float) -> float | None:
        """Seconds until the next call is due (0: now), None while nothing is."""
        with self._cond:
            if self.client is None:
                return None
            renew = self.ttl_s * RENEW_FRACTION
            if self.hold is not None:
                return max(0.0, self._tried_at + renew - now)
            if self._want != self._sent:
                return max(0.0, self._tried_at + self.retry_s - now)
            if self._want is None:
                return None
            if self.error is not None:  # a renewal that failed: tried again soon
                return max(0.0, self._tried_at + self.retry_s - now)
            return max(0.0, self._sent_at + renew - now)

    def step(self, now: float) -> None:
        """One call to the worker if one is due at `now`."""
        due = self.due_in(now)
        if due is None or due > 0:
            return
        with self._cond:
            want, reason, signal, sent = self._want, self._reason, self._signal, self._sent
        action = "release" if want is None else "renew" if want == sent else "throttle"
        params: dict[str, Any] = {"reason": reason} if want is None else {"reason": reason, "ttl_s": self.ttl_s, **want}
        if self.dry_run:
            if action != "renew":
                log.info("dry-run: would %s worker %s: %s", action, self.name, params)
            self._done(want, action, signal, now)
            return
        assert self.client is not None
        try:
            self.client.call("release" if want is None else "throttle", **params)
        except ControlError as exc:  # absent, loading, wedged or restarting: its own lane retries
            with self._cond:
                self._tried_at = now
                if exc.code == THROTTLE_HELD:
                    self._held(exc.data, action)
                    return
                if self.error != str(exc):
                    log.warning("worker %s: %s failed: %s", self.name, action, exc)
                self.error = str(exc)
            return
        with self._cond:
            if self.hold is not None:
                log.info("worker %s: the operator's hold is over: the agent throttles it again", self.name)
                self.hold = None
        log.log(logging.DEBUG if action == "renew" else logging.INFO, "worker %s: %s %s", self.name, action, params)
        self._done(want, action, signal, now)

    def _done(self, want: dict | None, action: str, signal: str, now: float) -> None:
        with self._cond:
            self.error = None
            self._sent, self._sent_at = want, now
            self.counts[(action, signal)] += 1
            self._cond.notify_all()

    def _held(self, data: object, action: str) -> None:
        hold = data.get("hold") if isinstance(data, dict) else None
        hold = hold if isinstance(hold, dict) else {}
        if self.hold is None:
            log.warning(
                "worker %s held by the operator (%s): not changing its throttle (%s refused) until released or expired",
                self.name,
                hold.get("reason", "no reason given"),
                action,
            )
        self.hold, self.error = hold, None
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    due = self.due_in(time.monotonic())
                    if due == 0:
                        break
                    self._cond.wait(due)
                if self._stop:
                    return
            self.step(time.monotonic())
