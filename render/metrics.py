"""The worker's Prometheus metrics (`turbonode_worker_*`, base units).

Events (a step ran, a job waited, a GC paused, a job ended) go into histograms and
counters as they happen. Levels (queue depth, in-flight jobs, text-cache counts) are read
from the engine at scrape time by a Collector that builds fresh families every scrape.
Everything lives in one CollectorRegistry the caller owns, so tests use a fresh one.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from turbonode.tiers import PRIORITY_ORDER

log = logging.getLogger(__name__)

P = "turbonode_worker_"
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            P + "step_duration_seconds", "Wall time of one batched UNet step", buckets=STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            P + "batch_images", "Images in one UNet step", buckets=(1, 2, 4, 8, 16, 32), registry=r
        )
        self.queue_wait = Histogram(
            P + "queue_wait_seconds",
            "Time from submission to a job's first step",
            ["tier"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            P + "gc_pause_seconds", "Pause of one garbage collection", ["generation"], buckets=GC_BUCKETS, registry=r
        )
        self.jobs = Counter(P + "jobs", "Jobs that ended, by tier and outcome", ["tier", "outcome"], registry=r)

    def observe_step(self, seconds: float, images: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(images)

    def observe_queue_wait(self, tier: str, seconds: float) -> None:
        self.queue_wait.labels(tier).observe(seconds)

    def observe_gc(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)

    def job_finished(self, tier: str, outcome: str) -> None:
        self.jobs.labels(tier, outcome).inc()

    def watch(self, engine) -> None:
        """Export the engine's levels at scrape time."""
        self.registry.register(EngineCollector(engine))


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
        enc = self.engine.encoder
        yield CounterMetricFamily(P + "text_cache_hits", "Prompt embeddings served from the cache", value=enc.hits)
        yield CounterMetricFamily(P + "text_cache_misses", "Prompt embeddings computed", value=enc.misses)
        yield GaugeMetricFamily(P + "text_cache_entries", "Prompt embeddings cached", value=len(enc))
