"""Faults for the sandbox node (sandbox/node.py), each bounded in time and inside what the node
owns: its namespaces, its cgroups, its processes.

  cpu        stress-ng on every CPU, in a session of its own (its own autogroup), nice 0
  cpu-batch  the same at nice 19 in the node's batch cgroup, where users run batch work
  softirq    a UDP flood into the node (iperf3 from the client, 64-byte datagrams, unlimited rate)
  bulk       unmarked iperf3 TCP flows out of the node to the client
  memory     a job in the batch cgroup allocating until the node reclaims (PSI memory some above
             10 %), then holding there (sandbox/pressure.py hold); started again 2 s after the
             kernel kills it, should it overshoot into an OOM
  memory-stream  a job in the batch cgroup reading a file twice the node's RAM through the page
             cache, over and over (sandbox/pressure.py stream)
  oom        a job of OOM_PROCS processes in the batch cgroup growing past what the node has
             (100 MiB/s together, each process smaller than the worker), started again 2 s after
             each time the kernel kills one of them, as a batch scheduler retries a failed job
  io         a job in the batch cgroup writing with an fsync per MiB, into a file of at most
             IO_FILE_MB in the node's temporary directory, deleted at the end

The memory faults need the node's memory cgroup (node_memory_mb, sandbox/node_memory.py): it
bounds what they allocate. `start` returns the processes; every one of them also ends by itself
after `seconds`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from .netns import Sandbox
from .node_memory import NodeMemory

FAULTS = ("cpu", "cpu-batch", "softirq", "bulk", "memory", "memory-stream", "oom", "io")
MEMORY_FAULTS = ("memory", "memory-stream", "oom")
BULK_FLOWS = 4
UDP_STREAMS = 2
BULK_PORT, UDP_PORT = 5301, 5302
SERVER_UP_S = 0.5  # iperf3's server listening before its client starts
PSI_TARGET = 0.10  # memory: the stall the job holds the node at
OOM_GROWTH_MB_PER_S = 100
OOM_RETRY_S = 2
# oom: the job's processes each end smaller than the worker, as a data loader's workers do: the
# OOM killer, which picks the largest process, then picks the worker unless told otherwise
OOM_PROCS = 8
IO_FILE_MB = 512


class FaultHost(Protocol):
    """What a fault needs of the node it runs on (sandbox/node.py's DemoNode is one)."""

    sandbox: Sandbox
    batch_cgroup: str
    tmp: Path
    memory: NodeMemory

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen: ...

    def in_cgroup(self, cgroup: str, argv: list[str]) -> list[str]: ...


def start(node: FaultHost, names: tuple[str, ...], seconds: float) -> list[subprocess.Popen]:
    unknown = set(names) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)} (known: {', '.join(FAULTS)})")
    if set(names) & set(MEMORY_FAULTS) and node.memory.memory is None:
        raise ValueError("the memory faults need the node's memory cgroup (node_memory_mb), which bounds them")
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
    for name, argv in pressure(node, names, t).items():
        procs.append(node.spawn(name, node.in_cgroup(node.batch_cgroup, argv)))
    return procs


def pressure(node: FaultHost, names: tuple[str, ...], seconds: str) -> dict[str, list[str]]:
    """The sandbox/pressure.py programs of the memory and io faults among `names`, by name."""
    run = [sys.executable, "-m", "sandbox.pressure"]
    ram = node.memory.memory_mb
    out = {}
    if "memory" in names:
        hold = [*run, "hold", "--node", node.memory.parent, "--target", str(PSI_TARGET)]
        out["memory-hold"] = [*hold, "--retry-s", str(OOM_RETRY_S), "--seconds", seconds]
    if "memory-stream" in names:
        out["memory-stream"] = [*run, "stream", "--dir", str(node.tmp), "--size-mb", str(2 * ram), "--seconds", seconds]
    if "oom" in names:
        grow = [*run, "grow", "--mb-per-s", str(OOM_GROWTH_MB_PER_S), "--procs", str(OOM_PROCS)]
        out["oom-grow"] = [*grow, "--retry-s", str(OOM_RETRY_S), "--seconds", seconds]
    if "io" in names:
        out["io-write"] = [*run, "write", "--dir", str(node.tmp), "--size-mb", str(IO_FILE_MB), "--seconds", seconds]
    return out
