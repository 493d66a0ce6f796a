"""Faults for the sandbox node (sandbox/node.py), each bounded in time and inside what the node
owns: its namespaces, its cgroups, its processes.

  cpu        stress-ng on every CPU, in a session of its own (its own autogroup), nice 0
  cpu-batch  the same at nice 19 in the node's batch cgroup, where users run batch work
  softirq    a UDP flood into the node (iperf3 from the client, 64-byte datagrams, unlimited rate)
  bulk       unmarked iperf3 TCP flows out of the node to the client

`start` returns the processes; every one of them also ends by itself after `seconds`.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Protocol

from .netns import Sandbox

FAULTS = ("cpu", "cpu-batch", "softirq", "bulk")
BULK_FLOWS = 4
UDP_STREAMS = 2
BULK_PORT, UDP_PORT = 5301, 5302
SERVER_UP_S = 0.5  # iperf3's server listening before its client starts


class FaultHost(Protocol):
    """What a fault needs of the node it runs on (sandbox/node.py's DemoNode is one)."""

    sandbox: Sandbox
    batch_cgroup: str

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen: ...

    def in_cgroup(self, cgroup: str, argv: list[str]) -> list[str]: ...


def start(node: FaultHost, names: tuple[str, ...], seconds: float) -> list[subprocess.Popen]:
    unknown = set(names) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)} (known: {', '.join(FAULTS)})")
    sb = node.sandbox
    t = str(int(seconds) + 1)
    stress = ["stress-ng", "--cpu", str(os.cpu_count() or 1), "--timeout", f"{t}s", "--quiet"]
    procs = []
    if "cpu" in names:
        procs.append(node.spawn("stress-ng", stress))
    if "cpu-batch" in names:
        procs.append(node.spawn("stress-ng-batch", node.in_cgroup(node.batch_cgroup, ["nice", "-n", "19", *stress])))
    if "softirq" in names:
        procs.append(node.spawn("udp-server", sb.cmd(sb.server, "iperf3", "-s", "-p", str(UDP_PORT))))
        time.sleep(SERVER_UP_S)
        flood = ["iperf3", "-c", sb.server_ip, "-p", str(UDP_PORT), "-u", "-b", "0", "-l", "64"]
        procs.append(node.spawn("udp-flood", sb.cmd(sb.client, *flood, "-P", str(UDP_STREAMS), "-t", t)))
    if "bulk" in names:
        procs.append(node.spawn("bulk-server", sb.cmd(sb.client, "iperf3", "-s", "-p", str(BULK_PORT))))
        time.sleep(SERVER_UP_S)
        bulk = ["iperf3", "-c", sb.client_ip, "-p", str(BULK_PORT), "-P", str(BULK_FLOWS), "-t", t]
        procs.append(node.spawn("bulk", sb.cmd(sb.server, *bulk)))
    return procs
