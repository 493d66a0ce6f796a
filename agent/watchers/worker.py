"""The worker's own view over its control socket: GC pauses, per-tier queue wait, step time.

An absent or restarting worker is a failed sample (reported), never an exception upstream.
"""

from __future__ import annotations

from turbonode.jsonrpc import ControlClient

from .base import Watcher


class WorkerWatcher(Watcher):
    name = "worker"

    def __init__(self, client: ControlClient):
        super().__init__()
        self.client = client
        self._gc_seq: int | None = None

    def read(self, now):
        st = self.client.call("status", since_gc_seq=self._gc_seq)
        if not isinstance(st, dict):
            raise ValueError(f"the worker's status is not an object: {str(st)[:80]!r}")
        gc = st.get("gc") or {}
        last_seq = gc.get("last_seq")
        if self._gc_seq is None or last_seq is None or last_seq < self._gc_seq:
            pauses = []  # first contact or a restarted worker: its history is not news
        else:
            pauses = [p for p in gc.get("pauses", []) if p.get("seq", 0) > self._gc_seq]
        self._gc_seq = last_seq
        tiers = st.get("tiers") or {}
        turbo = tiers.get("turbo") or {}
        step = st.get("step_time_s") or {}
        signals = {
            "gc_pause_s": max((p["pause_s"] for p in pauses), default=None),
            "turbo_wait_s": turbo.get("oldest_wait_s"),
            "step_time_p99_s": step.get("p99"),
        }
        detail = {
            "tiers": tiers,
            "step_time_s": step,
            "throttle": st.get("throttle"),
            "max_batch": st.get("max_batch"),
            "backend": st.get("backend"),
            "gc_pauses": pauses,
            "uptime_s": st.get("uptime_s"),
        }
        return signals, detail

    def status_view(self) -> dict:
        if not self.ok:
            return {"worker": {"state": "absent", "error": self.error}}
        d = self.detail
        return {
            "worker": {
                "state": "ok",
                "tiers": d.get("tiers"),
                "throttle": d.get("throttle"),
                "max_batch": d.get("max_batch"),
                "step_time_s": d.get("step_time_s"),
                "backend": d.get("backend"),
            }
        }
