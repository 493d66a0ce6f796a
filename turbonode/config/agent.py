"""[agent]: the host agent's sockets, sampling and throttle lifetime (agent/)."""

from __future__ import annotations

from dataclasses import dataclass

from ..throttle_params import check_ttl
from .checks import host_port, in_range, opt

# The agent's sampling period: below 50 ms the sampler costs more CPU than it saves; above a
# minute it reacts to nothing (and time arithmetic overflows long before 1e300).
SAMPLE_PERIOD_RANGE_S = (0.05, 60.0)


@dataclass
class AgentConfig:
    worker_socket: str = opt(
        "/run/turbonode/worker.sock",
        help="control socket of the worker to throttle, on a node without [workers] tables (each names its own)",
    )
    socket: str = opt("/run/turbonode/agent.sock", help="the agent's own status socket")
    metrics: str = opt("0.0.0.0:9465", host_port, "Prometheus metrics address")
    sample_period: float = opt(
        0.1,
        in_range(*SAMPLE_PERIOD_RANGE_S, " s"),
        "seconds between samples (sources that push are sampled at once too)",
    )
    throttle_ttl: float = opt(3.0, check_ttl, "seconds a throttle lasts unless renewed")
    procfs: str = opt("/proc", help="procfs root (host /proc in a container)")
    sysfs: str = opt("/sys", help="sysfs root")
    dry_run: bool = opt(False, help="log what the policy would do; change nothing")
