"""The worker's Prometheus metrics (`turbonode_worker_*`, base units; names shared with the
dashboard and the alerts in turbonode/metric_names.py).

Events (a request answered, a job passed a stage, a step ran, a GC paused, a job ended) go
into histograms and counters as they happen. Levels (queue depth, in-flight jobs, readiness,
text-cache counts) are read at scrape time by Collectors that build fresh families every
scrape. Everything lives in one CollectorRegistry the caller owns, so tests use a fresh one.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from render.accounts.keys import AUTH_FAILURES
from render.front.full_collections import RAN_WHEN
from turbonode.metric_names import (
    CAPACITY,
    DENOISE_STEPS,
    LOAD,
    LOAD_WINDOW_S,
    READY,
    REQUEST_BUCKETS,
    REQUEST_DURATION,
    REQUEST_STAGE,
    REQUESTS,
    SLO,
    STAGES,
    STEP_SLOWDOWN,
    WEIGHT,
)
from turbonode.tier_headers import ACCOUNT_HEADER, DOWNGRADE_REASONS, TIER_HEADER
from turbonode.tiers import PRIORITY_ORDER, TIER_NAMES

log = logging.getLogger(__name__)

P = "turbonode_worker_"
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
GC_PAUSE = P + "gc_pause_seconds"
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.served = RecentRate(LOAD_WINDOW_S, clock)  # requests answered with images or queued, per tier
        self.request_duration = Histogram(
            REQUEST_DURATION,
            "Generation requests, from arrival to the response written, by tier and outcome",
            ["tier", "outcome"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.request_stage = Histogram(
            REQUEST_STAGE,
            "Where a generation request's time went, by tier and stage (queue_wait, denoise, decode, respond)",
            ["tier", "stage"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            REQUESTS, "Generation requests answered, by tier and HTTP status code", ["tier", "code"], registry=r
        )
        self.denoise_steps = Counter(DENOISE_STEPS, "Denoising steps done per image, by tier", ["tier"], registry=r)
        self.step_seconds = Histogram(
            P + "step_duration_seconds", "Wall time of one batched UNet step", buckets=STEP_BUCKETS, registry=r
        )
        self.decode_seconds = Histogram(
            P + "decode_duration_seconds", "Wall time of one batched VAE decode", buckets=STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            P + "batch_images", "Images in one UNet step", buckets=(1, 2, 4, 8, 16, 32), registry=r
        )
        self.gc_pause = Histogram(
            GC_PAUSE, "Pause of one garbage collection", ["generation"], buckets=GC_BUCKETS, registry=r
        )
        self.full_collections = Counter(
            P + "full_collections",
            "Full garbage collections of the front, run out of band (render/front/full_collections.py), by "
            "when: quiet (no turbo request in the front) or overdue (after waiting the longest they may)",
            ["when"],
            registry=r,
        )
        self.jobs = Counter(P + "jobs", "Jobs that ended, by tier and outcome", ["tier", "outcome"], registry=r)
        # accounts (render/accounts/)
        self.downgrades = Counter(
            P + "tier_downgrades",
            "Generation requests run in a lower tier than they asked for, by tier asked for and reason",
            ["tier", "reason"],
            registry=r,
        )
        self.engine_seconds = Counter(
            P + "engine_seconds",
            "Engine seconds charged to each key, by tier: a job's share of every batched denoiser and decoder call",
            ["key", "tier"],
            registry=r,
        )
        self.auth_failures = Counter(
            P + "auth_failures", "Requests refused 401, by reason (missing, unknown, revoked)", ["reason"], registry=r
        )
        self.untrusted_headers = Counter(
            P + "untrusted_headers",
            "Tier or account headers ignored: sent from an address outside worker.trusted_proxies",
            ["header"],
            registry=r,
        )
        self.http_malformed = Counter(
            P + "http_malformed_requests", "HTTP messages the server could not parse (answered 400)", registry=r
        )
        # The series a dashboard or an alert divides or takes quantiles of exist from the start, at
        # 0: Prometheus takes a series' first sample as its baseline, so a lazily created one
        # would lose its first events (the first requests after a restart).
        for tier in TIER_NAMES:
            self.denoise_steps.labels(tier)
            self.jobs.labels(tier, "done")
            for outcome in ("ok", "rejected"):
                self.request_duration.labels(tier, outcome)
            for stage in STAGES:
                self.request_stage.labels(tier, stage)
            for code in ("200", "429", "503"):
                self.requests.labels(tier, code)
            for reason in DOWNGRADE_REASONS:
                self.downgrades.labels(tier, reason)
        for reason in AUTH_FAILURES:
            self.auth_failures.labels(reason)
        for when in RAN_WHEN:
            self.full_collections.labels(when)
        for header in (TIER_HEADER, ACCOUNT_HEADER):
            self.untrusted_headers.labels(header)
        # Also because the GC callback (render/gc_telemetry.py) observes into gc_pause from inside
        # a collection, in whatever thread allocated: creating a series allocates under the
        # metric's lock, so a collection started there would wait for that lock in the same
        # thread forever (the front records the engine process's pauses on its event loop).
        # With every series made here, observing takes a lock only around a float add.
        for generation in range(len(gc.get_count())):
            self.gc_pause.labels(str(generation))

    def request_answered(self, tier: str, outcome: str, code: int, seconds: float) -> None:
        self.request_duration.labels(tier, outcome).observe(seconds)
        self.requests.labels(tier, str(code)).inc()
        if outcome in ("ok", "accepted"):
            self.served.mark(tier)

    def observe_stage(self, tier: str, stage: str, seconds: float) -> None:
        self.request_stage.labels(tier, stage).observe(seconds)

    def observe_step(self, seconds: float, tiers: Iterable[str]) -> None:
        """One batched UNet step: `tiers` has one entry per image in the batch."""
        per_tier = collections.Counter(tiers)
        self.step_seconds.observe(seconds)
        self.batch_size.observe(sum(per_tier.values()))
        for tier, n in per_tier.items():
            self.denoise_steps.labels(tier).inc(n)

    def observe_decode(self, seconds: float) -> None:
        """One batched VAE decode."""
        self.decode_seconds.observe(seconds)

    def observe_gc(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)

    def full_collection_ran(self, when: str) -> None:
        self.full_collections.labels(when).inc()

    def job_finished(self, tier: str, outcome: str) -> None:
        self.jobs.labels(tier, outcome).inc()

    def watch(self, engine) -> None:
        """Export the engine's levels at scrape time."""
        self.registry.register(EngineCollector(engine))

    def watch_accounts(self, accounts) -> None:
        """Export the keys and the ledger's state at scrape time (render/accounts/)."""
        self.registry.register(AccountsCollector(accounts))

    def watch_readiness(self, ready: Callable[[str], bool], slo: Mapping[str, float]) -> None:
        """Export each tier's readiness (what GET /readyz?tier=T answers) and objective at scrape time."""
        self.registry.register(ReadinessCollector(ready, slo))

    def watch_load(self, capacity: Mapping[str, float]) -> None:
        """Export each tier's served rate and, where configured, its capacity at scrape time."""
        self.registry.register(LoadCollector(capacity, self.served))


class RecentRate:
    """Events per second over the last `window` seconds, per key (a deque of times per key)."""

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self._times: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def mark(self, key: str) -> None:
        now = self.clock()
        with self._lock:
            times = self._times[key]
            times.append(now)
            self._expire(times, now)

    def rate(self, key: str) -> float:
        now = self.clock()
        with self._lock:
            times = self._times[key]
            self._expire(times, now)
            return len(times) / self.window

    def _expire(self, times: collections.deque[float], now: float) -> None:
        while times and times[0] <= now - self.window:
            times.popleft()


class LoadCollector:
    """turbonode_worker_load_requests_per_second{tier} and, for the tiers worker.capacity names,
    turbonode_worker_capacity_requests_per_second{tier}: the headroom a balancer or an autoscaler
    reads (docs/fleet.md)."""

    def __init__(self, capacity: Mapping[str, float], served: RecentRate):
        self.capacity, self.served = capacity, served

    def describe(self):
        return []

    def collect(self):
        load = GaugeMetricFamily(
            LOAD,
            f"Requests of the tier served (images or a queued job) per second over the last {LOAD_WINDOW_S:g} s",
            labels=["tier"],
        )
        for tier in PRIORITY_ORDER:
            load.add_metric([tier], self.served.rate(tier))
        yield load
        capacity = GaugeMetricFamily(
            CAPACITY,
            "Requests of the tier per second the node sustains within the tier's objective (worker.capacity)",
            labels=["tier"],
        )
        for tier, rate in self.capacity.items():
            capacity.add_metric([tier], rate)
        yield capacity


class ReadinessCollector:
    """turbonode_worker_ready{tier} and turbonode_worker_slo_seconds{tier}; from the HTTP server
    up, so a worker still loading its model shows 0 rather than nothing."""

    def __init__(self, ready: Callable[[str], bool], slo: Mapping[str, float]):
        self.ready, self.slo = ready, slo

    def describe(self):
        return []

    def collect(self):
        ready = GaugeMetricFamily(
            READY, "1 while the worker takes new work of the tier (GET /readyz?tier=T)", labels=["tier"]
        )
        for tier in PRIORITY_ORDER:
            ready.add_metric([tier], int(self.ready(tier)))
        yield ready
        slo = GaugeMetricFamily(SLO, "The tier's request-duration objective (worker.slo)", labels=["tier"])
        for tier, seconds in self.slo.items():
            slo.add_metric([tier], seconds)
        yield slo


class AccountsCollector:
    """The keys loaded and the ledger's state: reachable, charges not yet written, failures."""

    def __init__(self, accounts):
        self.accounts = accounts

    def describe(self):
        return []

    def collect(self):
        keyring, ledger = self.accounts.keyring, self.accounts.ledger
        if keyring is None:
            return
        yield GaugeMetricFamily(P + "keys", "API keys loaded from worker.keys_file", value=len(keyring.keys))
        yield CounterMetricFamily(
            P + "keys_reload_failures",
            "Changes to worker.keys_file that did not validate (the keys before stayed in force)",
            value=keyring.failed_reloads,
        )
        if ledger is None:
            return
        yield GaugeMetricFamily(
            P + "ledger_up", "1 while the ledger's store (Redis or the embedded file) answers", value=int(ledger.up)
        )
        yield GaugeMetricFamily(
            P + "ledger_unwritten_seconds",
            "Engine seconds charged here and not yet written to the ledger's store",
            value=ledger.unwritten_us / 1e6,
        )
        yield CounterMetricFamily(
            P + "ledger_failures", "Reads and writes of the ledger's store that failed", value=ledger.failures
        )


class EngineCollector:
    """Queue depth, in-flight jobs, max batch and text-cache counters, read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # levels are read live; skip the describe-time collect

    def collect(self):
        ok = GaugeMetricFamily(P + "collector_success", "1 when the engine collector read the engine")
        try:
            families = list(self._families())
        except Exception:  # noqa: BLE001 - a scrape must answer even when reading the engine fails
            log.exception("engine collector failed")
            ok.add_metric([], 0)
            yield ok
            return
        yield from families
        ok.add_metric([], 1)
        yield ok

    def _families(self):
        snap = self.engine.snapshot()
        queued = GaugeMetricFamily(P + "queue_depth", "Jobs waiting for their first step", labels=["tier"])
        in_flight = GaugeMetricFamily(P + "in_flight", "Jobs denoising or decoding", labels=["tier"])
        for tier in PRIORITY_ORDER:
            queued.add_metric([tier], snap["tiers"][tier]["queued"])
            in_flight.add_metric([tier], snap["tiers"][tier]["in_flight"])
        yield queued
        yield in_flight
        yield GaugeMetricFamily(
            P + "max_batch", "Largest UNet batch now allowed (throttle included)", value=snap["max_batch"]
        )
        throttled = self.engine.throttle.current() is not None
        yield GaugeMetricFamily(P + "throttled", "1 while a throttle from the agent is in force", value=int(throttled))
        speed = snap["speed"]
        yield GaugeMetricFamily(
            WEIGHT,
            "The weight HAProxy's agent-check reads, percent of its configured one",
            value=speed["weight_percent"],
        )
        if speed["slowdown"] is not None:
            yield GaugeMetricFamily(
                STEP_SLOWDOWN, "Recent denoising step time over the worker's usual one", value=speed["slowdown"]
            )
        cache = snap["text_cache"]
        yield CounterMetricFamily(P + "text_cache_hits", "Prompt embeddings served from the cache", value=cache["hits"])
        yield CounterMetricFamily(P + "text_cache_misses", "Prompt embeddings computed", value=cache["misses"])
        yield GaugeMetricFamily(P + "text_cache_entries", "Prompt embeddings cached", value=cache["entries"])
