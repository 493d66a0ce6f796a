"""Prometheus collectors: one per watcher (its `_collector_success` plus what only it knows; a
worker's watchers' series carry its `worker` label), and one for the policy. Families are built
fresh on every scrape from the latest sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from turbonode.config import split_host_port
from turbonode.errors import TurbonodeError
from turbonode.exposition import NodeLabelled, daemon_registry, labelled
from turbonode.levels import LEVELS
from turbonode.metric_names import LEVER_MODE, WORKER_LABEL

from .watchers.base import Watcher

PolicyState = tuple[dict[str, int], Counter, dict[tuple[str, str], bool]]  # AgentLoop.metrics_state


def watcher_families(w: Watcher) -> list[Metric]:
    """A watcher's `_collector_success` and what only it knows."""
    success = GaugeMetricFamily(
        f"turbonode_{w.name}_collector_success", f"1 if the {w.name} watcher's last sample succeeded"
    )
    success.add_metric([], 1.0 if w.collector_ok() else 0.0)
    return [success, *w.families()]


class WatcherCollector:
    def __init__(self, watcher: Watcher):
        self.watcher = watcher

    def collect(self):
        yield from watcher_families(self.watcher)

    def describe(self):
        return []  # no collect() at registration: the probe may not be ready yet


class WorkerWatchersCollector:
    """Every worker's own watchers, each series with its `worker` label: one family per metric
    name, the workers' samples together (an exposition names a metric once)."""

    def __init__(self, worker_watchers: dict[str, list[Watcher]]):
        self.worker_watchers = worker_watchers

    def collect(self):
        families: dict[str, Metric] = {}
        for worker, watchers in self.worker_watchers.items():
            for w in watchers:
                for metric in labelled(watcher_families(w), {WORKER_LABEL: worker}):
                    if metric.name in families:
                        families[metric.name].samples.extend(metric.samples)
                    else:
                        families[metric.name] = metric
        yield from families.values()

    def describe(self):
        return []  # no collect() at registration: the probe may not be ready yet


class PolicyCollector:
    """Each worker's degradation level, the actions and the levers; `state` is
    AgentLoop.metrics_state. What the agent does for the node (the relax ceil, cpu_share) has
    worker '' (Prometheus keeps no empty label: those series have none)."""

    def __init__(self, state: Callable[[], PolicyState]):
        self.state = state

    def collect(self):
        levels, counts, levers = self.state()
        g = GaugeMetricFamily(
            "turbonode_degradation_level",
            f"Degradation level of the worker (its own rules and the node's): "
            f"{', '.join(f'{i} {n}' for i, n in enumerate(LEVELS))}",
            labels=[WORKER_LABEL],
        )
        for worker, level in levels.items():
            g.add_metric([worker], level)
        yield g
        c = CounterMetricFamily(
            "turbonode_throttle_actions",
            "Actions the agent took, by signal that caused them (worker: the one it acted on)",
            labels=["action", "reason", WORKER_LABEL],
        )
        for (action, reason, worker), n in sorted(counts.items()):
            c.add_metric([action, reason, worker], n)
        yield c
        engaged = GaugeMetricFamily(
            "turbonode_lever_engaged",
            "1 while the policy has the lever engaged (agent/levers/; worker: a lever of one worker)",
            labels=["lever", WORKER_LABEL],
        )
        for (name, worker), on in sorted(levers.items()):
            engaged.add_metric([name, worker], 1.0 if on else 0.0)
        yield engaged

    def describe(self):
        return []


LeverModes = Callable[[], dict[str, tuple[str, tuple[str, ...]]]]  # lever -> (its mode, the modes it has)


class LeverModeCollector:
    """What each lever can do on this host (Levers.modes): 1 for the mode in effect."""

    def __init__(self, modes: LeverModes):
        self.modes = modes

    def collect(self):
        g = GaugeMetricFamily(
            LEVER_MODE,
            "1 for the mode the lever has on this host (agent/levers/; io_weight: weight, weight+throttle, "
            "throttle where no proportional io policy schedules a disk, off where nothing can be had)",
            labels=["lever", "mode"],
        )
        for lever, (mode, modes) in sorted(self.modes().items()):
            for m in modes:
                g.add_metric([lever, m], 1.0 if m == mode else 0.0)
        yield g

    def describe(self):
        return []


def build_registry(
    watchers: list[Watcher],
    policy_state: Callable[[], PolicyState],
    node: str = "",
    worker_watchers: dict[str, list[Watcher]] | None = None,
    lever_modes: LeverModes | None = None,
) -> NodeLabelled:
    """The agent's exposition: build info, process metrics, a collector per watcher (the node's,
    and each worker's with its `worker` label) and the policy's, every series labelled with the
    node's name ('' = the hostname)."""
    reg, served = daemon_registry("agent", node)
    for w in watchers:
        reg.register(WatcherCollector(w))
    reg.register(WorkerWatchersCollector(worker_watchers or {}))
    reg.register(PolicyCollector(policy_state))
    if lever_modes is not None:
        reg.register(LeverModeCollector(lever_modes))
    return served


def serve(registry: CollectorRegistry | NodeLabelled, address: str):
    """Start the /metrics HTTP server on HOST:PORT; returns the server (port 0 picks one)."""
    from prometheus_client import start_http_server

    host, port = split_host_port(address)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise TurbonodeError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from None
    return server
