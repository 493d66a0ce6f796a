"""The worker's own view over its control socket: GC pauses, per-tier queue wait, step time.

Fed by a WorkerFeed thread (agent/watchers/worker_feed.py): the worker pushes GC pauses and turbo
queue-wait excursions as they happen, through the feed's eventfd (wake_fds), so the agent samples
at once; the loop itself never blocks on the worker. A sample is taken only when the feed has
news, so each GC pause is observed once. An absent, stuck or restarting worker is a failed
sample (reported), never an exception upstream.
"""

from __future__ import annotations

import select
from typing import Any

from turbonode.errors import ControlError
from turbonode.jsonrpc import WORKER_LOADING

from .base import Signals, Watcher
from .worker_feed import WorkerFeed


class WorkerWatcher(Watcher):
    name = "worker"
    signal_names = ("gc_pause_s", "turbo_wait_s", "step_time_p99_s")  # about its worker: per-worker rules

    def __init__(self, feed: WorkerFeed):
        super().__init__()
        self.feed = feed
        self._status: dict[str, Any] = {}
        self._tiers: dict[str, Any] = {}

    def due(self, now: float) -> bool:
        self.feed.start()
        return self.feed.fresh()

    def read(self, now: float) -> tuple[Signals, dict]:
        news = self.feed.take()
        if news.error is not None:
            raise ControlError(news.error)
        if news.status is not None:
            named = news.status.get("name", self.feed.name)  # a worker from before names had none
            if named != self.feed.name:
                raise ControlError(
                    f"{self.feed.client.path} answers as worker {named!r}, not {self.feed.name!r}: "
                    "two workers' sockets crossed in the configuration?"
                )
            self._status = news.status
        if news.tiers is not None:
            self._tiers = news.tiers
        step = (news.status or {}).get("step_time_s") or {}
        signals = {
            "gc_pause_s": max((p["pause_s"] for p in news.pauses), default=None),
            "turbo_wait_s": (news.tiers or {}).get("turbo", {}).get("oldest_wait_s"),
            "step_time_p99_s": step.get("p99"),
        }
        st = self._status
        detail = {
            "tiers": self._tiers,
            "step_time_s": st.get("step_time_s"),
            "throttle": st.get("throttle"),
            "max_batch": st.get("max_batch"),
            "backend": st.get("backend"),
            "gc_pauses": news.pauses,
            "uptime_s": st.get("uptime_s"),
        }
        return signals, detail

    def pids(self) -> list[int]:
        """The worker's processes as its latest status named them (none before the first)."""
        pids = self._status.get("pids")
        if not isinstance(pids, list):
            return []
        return [p for p in pids if isinstance(p, int) and not isinstance(p, bool) and p > 0]

    def gpu_uuid(self) -> str | None:
        """The GPU the worker renders on, as NVML names it (its backend's `gpu_uuid`), once it said."""
        uuid = (self._status.get("backend") or {}).get("gpu_uuid")
        return uuid if isinstance(uuid, str) and uuid else None

    def pid(self) -> int | None:
        """The worker's main process (its front, the first it names): its cgroup is the worker's."""
        pids = self.pids()
        return pids[0] if pids else None

    def wake_fds(self) -> dict[int, int]:
        return {self.feed.efd: select.POLLIN}

    def woken(self, fd: int) -> None:
        self.feed.ack()

    def summary(self) -> dict:
        return {**super().summary(), "pushes": self.feed.pushes, "events": self.feed.has_events}

    def view(self) -> dict:
        """The worker as the agent last saw it, for its status (`workers.<name>`)."""
        if not self.ok:
            state = "loading" if self.error and WORKER_LOADING in self.error else "absent"
            return {"state": state, "error": self.error}
        d = self.detail
        return {
            "state": "ok",
            "tiers": d.get("tiers"),
            "throttle": d.get("throttle"),
            "max_batch": d.get("max_batch"),
            "step_time_s": d.get("step_time_s"),
            "backend": d.get("backend"),
        }

    def close(self) -> None:
        self.feed.close()
