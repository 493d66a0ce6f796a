"""Prometheus collectors: one per watcher (its `_collector_success` plus what only it knows),
and one for the policy. Families are built fresh on every scrape from the latest sample.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from turbonode.config import split_host_port
from turbonode.errors import TurbonodeError
from turbonode.exposition import NodeLabelled, daemon_registry
from turbonode.levels import LEVELS

from .watchers.base import Watcher


class WatcherCollector:
    def __init__(self, watcher: Watcher):
        self.watcher = watcher

    def collect(self):
        w = self.watcher
        ok = w.collector_ok()
        success = GaugeMetricFamily(
            f"turbonode_{w.name}_collector_success", f"1 if the {w.name} watcher's last sample succeeded"
        )
        success.add_metric([], 1.0 if ok else 0.0)
        yield success
        yield from w.families()

    def describe(self):
        return []  # no collect() at registration: the probe may not be ready yet


class PolicyCollector:
    """Degradation level, actions and levers; `state` returns (level index, actuator counts,
    lever -> engaged)."""

    def __init__(self, state: Callable[[], tuple[int, dict, dict[str, bool]]]):
        self.state = state

    def collect(self):
        level, counts, levers = self.state()
        g = GaugeMetricFamily(
            "turbonode_degradation_level", f"Degradation level: {', '.join(f'{i} {n}' for i, n in enumerate(LEVELS))}"
        )
        g.add_metric([], level)
        yield g
        c = CounterMetricFamily(
            "turbonode_throttle_actions",
            "Actions the agent took, by signal that caused them",
            labels=["action", "reason"],
        )
        for (action, reason), n in sorted(counts.items()):
            c.add_metric([action, reason], n)
        yield c
        engaged = GaugeMetricFamily(
            "turbonode_lever_engaged", "1 while the policy has the lever engaged (agent/levers/)", labels=["lever"]
        )
        for name, on in sorted(levers.items()):
            engaged.add_metric([name], 1.0 if on else 0.0)
        yield engaged

    def describe(self):
        return []


def build_registry(watchers: list[Watcher], policy_state, node: str = "") -> NodeLabelled:
    """The agent's exposition: build info, process metrics, a collector per watcher and the
    policy's, every series labelled with the node's name ('' = the hostname)."""
    reg, served = daemon_registry("agent", node)
    for w in watchers:
        reg.register(WatcherCollector(w))
    reg.register(PolicyCollector(policy_state))
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
