"""The watcher contract: sample() never raises; failures are a reported state.

Whatever a source does, malformed data included (a worker's status missing a key, a value that
is not a number), the watcher is reported as failed and the agent keeps running.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from turbonode.errors import TurbonodeError

log = logging.getLogger("turbonode.agent")

Signals = dict[str, "float | None"]

# Rates over shorter windows are noise: /proc/stat counts USER_HZ ticks (10 ms), and a sample the
# loop takes at once on a push may follow the previous one by a millisecond. Rate watchers read
# no more often than this; in the samples between they have no observation (None).
MIN_RATE_WINDOW_S = 0.075


class Watcher:
    """Subclasses implement read(now) -> (signals, detail) and optionally families()."""

    name = "watcher"
    interval = 0.0  # seconds between reads; 0 = every sample. Costly sources read less often.

    def __init__(self):
        self.owner = ""  # whose watcher it is, for the log: '' (the node's) or 'worker NAME: '
        self.ok = False
        self.error: str | None = "not sampled yet"
        self.signals: Signals = {}
        self.detail: dict = {}
        self._read_at: float | None = None

    def due(self, now: float) -> bool:
        return self._read_at is None or now - self._read_at >= self.interval

    def read(self, now: float) -> tuple[Signals, dict]:
        raise NotImplementedError

    def sample(self, now: float) -> Signals:
        """Read the source and return its signals; between reads of a slow watcher, {}."""
        if not self.due(now):
            return {}
        self._read_at = now
        try:
            signals, detail = self.read(now)
            self.signals, self.detail = checked(signals), detail
        except Exception as exc:  # a failing watcher is a state, never the agent's death
            expected = isinstance(exc, (TurbonodeError, OSError, ValueError))
            error = str(exc) if expected else f"{type(exc).__name__}: {exc}"
            if self.ok or self.error != error:  # log transitions, not every failed sample
                # Anything else is malformed data or a bug: the traceback says where.
                log.warning("%s%s watcher failed: %s", self.owner, self.name, error, exc_info=not expected)
            self.ok, self.error, self.signals = False, error, {}
            return {}
        if not self.ok:
            log.info("%s%s watcher ok", self.owner, self.name)
        self.ok, self.error = True, None
        return self.signals

    def families(self) -> list:
        """Prometheus metric families beyond `_collector_success` (fresh objects each call)."""
        return []

    def summary(self) -> dict:
        """What `turboctl status` shows about this watcher under `watchers.<name>`."""
        return {"ok": self.ok, "error": self.error}

    def status_view(self) -> dict[str, Any]:
        """Top-level sections this watcher adds to the agent's status object; none by default."""
        return {}

    def wake_fds(self) -> dict[int, int]:
        """File descriptors (-> poll events) through which this source pushes news; the daemon
        polls them and samples at once when one fires. None by default: the source is polled."""
        return {}

    def woken(self, fd: int) -> None:
        """One of wake_fds() fired: acknowledge it (e.g. read an eventfd) before the sample."""

    def collector_ok(self) -> bool:
        """The `_collector_success` value: by default, whether the last read succeeded."""
        return self.ok

    def close(self) -> None:
        pass


def checked(signals: Signals) -> Signals:
    """The signals, if each is None or a finite number (the policy compares them with thresholds)."""
    for name, value in signals.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ValueError(f"signal {name} is not a finite number: {value!r}")
    return signals


class Rate:
    """Per-second rates of cumulative counters between two samples (None on the first)."""

    def __init__(self):
        self._last: tuple[float, dict] | None = None

    def update(self, now: float, counters: dict) -> dict | None:
        last, self._last = self._last, (now, counters)
        if last is None or now <= last[0]:
            return None
        dt = now - last[0]
        # A counter that went backwards (wrap, CPU hotplug) reads as zero, not negative.
        return {k: max(0, v - last[1].get(k, v)) / dt for k, v in counters.items()}
