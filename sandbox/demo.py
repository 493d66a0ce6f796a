"""`turboctl demo`: a sandbox node under mixed-tier load and a CPU fault, without and with turbonode.

The short form of bench/node_slo.py (one of its cells: the CPU hog and bulk egress at once),
on the same node and with the same load and summary. Two network namespaces joined by veth
(sandbox/netns.py) are the node and its client. The real worker (tiny model) serves HTTP inside
the node namespace, in a cgroup of its own, so its replies leave through the node's shaped
interface. Each phase runs the same load: turbo requests arriving open-loop (Poisson, one a
second) and closed-loop clients of the other tiers from the client namespace (sandbox.loadgen,
in a cgroup of its own at the top CPU weight: it stands for clients on other machines, whose
reading the node's CPU use cannot slow), bulk iperf3 flows from the node to the client, and
stress-ng on every CPU as the fault (sandbox/faults.py).

  without: the interface is a plain FIFO shaped to the same rate (HTB root, one class, pfifo),
           no agent;
  with:    the agent applies turbonode's QoS (eBPF classifier under the HTB tier tree), watches
           the node, throttles the worker's lower tiers while it is degraded and engages the
           levers of the rules that fire (the worker's CPU weight, its intra-op threads).

Everything is bounded in time and torn down on exit, also on Ctrl-C: processes by PID, the
namespaces (and with them the qdiscs), the cgroups, the temporary directory (sandbox/node.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Callable

from . import faults
from .interrupt import checkpoint
from .node import DemoError, DemoNode
from .settings import DemoSettings

NEEDS = ("ip", "tc", "iperf3", "stress-ng")


def preflight() -> None:
    """Refuse early, naming what is missing, rather than half-building a node."""
    if os.geteuid() != 0:
        raise DemoError("the demo needs root: it creates network namespaces, tc qdiscs and eBPF programs")
    missing = [n for n in NEEDS if shutil.which(n) is None]
    if missing:
        raise DemoError(f"missing programs: {', '.join(missing)} (run scripts/setup.sh)")


def run_demo(settings: DemoSettings, log: Callable[[str], object] = print, stop: threading.Event | None = None) -> dict:
    """Both phases on one node; returns {"settings", "without", "with"}."""
    preflight()
    with DemoNode(settings, log) as node:
        checkpoint(stop)
        log(
            f"phase 1/2: without turbonode (FIFO at {settings.rate}, no agent), {settings.duration:g} s of load "
            f"+ {faults.BULK_FLOWS} bulk flows" + (" + stress-ng on every CPU" if settings.stress else "")
        )
        node.plain_fifo()
        checkpoint(stop)
        without = node.run_load(watch_agent=False)
        checkpoint(stop)
        node.remove_fifo()
        checkpoint(stop)
        log("phase 2/2: with turbonode (eBPF classifier + HTB tiers, agent throttling the worker), same load")
        agent = node.start_agent()
        try:
            checkpoint(stop)
            with_ = node.run_load(watch_agent=True)
        finally:
            node.release(agent)
        checkpoint(stop)
    return {"settings": dataclasses.asdict(settings), "without": without, "with": with_}
