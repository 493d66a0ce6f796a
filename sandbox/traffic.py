"""Mixed-tier traffic through a sandbox node's shaped link: the datapath alone, no worker or agent.

build_node -> apply_qos -> run_mixed_traffic -> teardown (also on failure); `turboctl demo
--qos-only` runs it and prints what each tier got. Traffic stays inside the two network
namespaces the sandbox creates and deletes.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from turbonode.rates import format_rate
from turbonode.tiers import tos_byte

from .interrupt import checkpoint
from .netns import Sandbox

if TYPE_CHECKING:
    from tc.datapath import Datapath

# tier, sender-paced rate as a fraction of the link (None: as fast as TCP goes). Turbo traffic
# is interactive on a real node (image responses), so its flow stays under its guarantee
# instead of filling its queue. Each flow carries its tier's TOS byte.
FLOWS: tuple[tuple[str, float | None], ...] = (("turbo", 0.2), ("fast", None), ("other", None), ("relax", None))
BASE_PORT = 5201
PING_INTERVAL_S = 0.02
RTT = re.compile(r"time=([\d.]+) ms")


def build_node() -> Sandbox:
    """Two network namespaces joined by veth: 'server' is the node, 'client' its peer."""
    return Sandbox(prefix="td").create()


def apply_qos(sb: Sandbox, rate_bps: int) -> Datapath:
    from tc.datapath import Datapath  # pyroute2: only when a datapath is built

    dp = Datapath(sb.dev, sb.server)
    dp.apply(rate_bps=rate_bps)
    return dp


def run_mixed_traffic(sb: Sandbox, seconds: float, rate_bps: int) -> dict:
    """One iperf3 flow per tier from the node, all at once, plus an EF ping train; bounded."""
    servers = [
        sb.popen(
            sb.client,
            "iperf3",
            "-s",
            "-1",
            "-p",
            str(BASE_PORT + i),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(len(FLOWS))
    ]
    clients = {}
    try:
        time.sleep(0.3)
        for i, (tier, pace) in enumerate(FLOWS):
            paced = ["-b", str(int(rate_bps * pace)), "-l", "8K"] if pace else []  # small writes: no bursts
            clients[tier] = sb.popen(
                sb.server,
                "iperf3",
                "-c",
                sb.client_ip,
                "-p",
                str(BASE_PORT + i),
                "-S",
                str(tos_byte(tier)),
                "-t",
                str(int(seconds)),
                "-J",
                *paced,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        time.sleep(1)
        count = int((seconds - 2) / PING_INTERVAL_S)
        ping = sb.run(
            sb.server,
            "ping",
            "-n",
            "-Q",
            hex(tos_byte("turbo")),
            "-i",
            str(PING_INTERVAL_S),
            "-c",
            str(count),
            "-W",
            "1",
            sb.client_ip,
            timeout=seconds + 10,
            check=False,
        ).stdout
        rates = {}
        for tier, proc in clients.items():
            out, _ = proc.communicate(timeout=seconds + 15)
            try:
                rates[tier] = json.loads(out)["end"]["sum_received"]["bits_per_second"]
            except (ValueError, KeyError):
                rates[tier] = None
    finally:
        for p in [*clients.values(), *servers]:
            if p.poll() is None:
                p.kill()
            p.wait()
    rtts = sorted(float(x) for x in RTT.findall(ping))
    return {"throughput_bps": rates, "ef_ping_ms": rtts}


def teardown(sb: Sandbox, dp: Datapath | None) -> None:
    try:
        if dp is not None:
            dp.remove()
            dp.close()
    finally:
        sb.delete()


def run_qos_only(
    rate_bps: int, seconds: float, log: Callable[[str], object] = print, stop: threading.Event | None = None
) -> tuple[dict, dict]:
    """Build a node, shape it at `rate_bps`, run the mixed traffic; -> (`qos show` view, traffic).
    Everything is removed afterwards, also on failure or Ctrl-C (`stop`: see sandbox.demo.checkpoint)."""
    sb = dp = None
    try:
        sb = build_node()
        checkpoint(stop)
        log(
            f"sandbox node: netns {sb.server} ({sb.dev}) <-> netns {sb.client}; applying QoS at {format_rate(rate_bps)}"
        )
        dp = apply_qos(sb, rate_bps)
        checkpoint(stop)
        traffic = run_mixed_traffic(sb, seconds, rate_bps)
        checkpoint(stop)
        return dp.show(), traffic
    finally:
        if sb is not None:
            teardown(sb, dp)
