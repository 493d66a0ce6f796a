"""`turboctl demo`: a sandbox node under mixed-tier load, without and with turbonode.

The full demo (sandbox/demo.py) runs the worker, the agent, tiered image requests, bulk flows and
a CPU fault twice and compares what each tier saw. `--qos-only` shows the datapath alone:
build_node -> apply_qos -> run_mixed_traffic -> report -> teardown (also on failure).
Traffic stays inside two network namespaces the demo creates and deletes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import click

from turbonode.errors import TurbonodeError
from turbonode.rates import format_rate, parse_rate

from .params import RATE
from .qos_cmd import format_table

# tier, TOS byte of its flow (DSCP << 2: EF, AF41, unmarked, CS1), sender-paced rate as a
# fraction of the link (None: as fast as TCP goes). Turbo traffic is interactive on a real
# node (image responses), so its flow stays under its guarantee instead of filling its queue.
FLOWS = (("turbo", 0xB8, 0.2), ("fast", 0x88, None), ("other", 0x00, None), ("relax", 0x20, None))
BASE_PORT = 5201
RTT = re.compile(r"time=([\d.]+) ms")


def build_node():
    """Two network namespaces joined by veth: 'server' is the node, 'client' its peer."""
    from sandbox.netns import Sandbox

    return Sandbox(prefix="td").create()


def apply_qos(sb, rate_bps: int):
    from tc.datapath import Datapath

    dp = Datapath(sb.dev, sb.server)
    dp.apply(rate_bps=rate_bps)
    return dp


def run_mixed_traffic(sb, seconds: float, rate_bps: int) -> dict:
    """One iperf3 flow per tier from the node, all at once, plus an EF ping train; bounded."""
    servers = [sb.popen(sb.client, "iperf3", "-s", "-1", "-p", str(BASE_PORT + i),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(len(FLOWS))]
    clients = {}
    try:
        time.sleep(0.3)
        for i, (tier, tos, pace) in enumerate(FLOWS):
            paced = ["-b", str(int(rate_bps * pace)), "-l", "8K"] if pace else []  # small writes: no bursts
            clients[tier] = sb.popen(sb.server, "iperf3", "-c", sb.client_ip, "-p", str(BASE_PORT + i),
                                     "-S", str(tos), "-t", str(int(seconds)), "-J", *paced,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(1)
        count = int((seconds - 2) / 0.02)
        ping = sb.run(sb.server, "ping", "-n", "-Q", "0xb8", "-i", "0.02", "-c", str(count), "-W", "1",
                      sb.client_ip, timeout=seconds + 10, check=False).stdout
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


def report(view: dict, traffic: dict, rate_bps: int) -> str:
    lines = [f"Mixed traffic through a {format_rate(rate_bps)} link, one TCP flow per tier at once "
             "(turbo paced to 20 %, the others as fast as they can):"]
    for tier, bps in traffic["throughput_bps"].items():
        share = f"{bps / 1e6:6.1f} Mbit/s ({bps / rate_bps:4.0%} of the link)" if bps else "no result"
        lines.append(f"  {tier:<6} {share}")
    rtts = traffic["ef_ping_ms"]
    if rtts:
        p99 = rtts[min(len(rtts) - 1, int(0.99 * (len(rtts) - 1)))]
        lines.append(f"  EF ping under that load: p50 {rtts[len(rtts) // 2]:.3f} ms, p99 {p99:.3f} ms "
                     f"({len(rtts)} replies)")
    lines += ["", "turboctl qos show:", format_table(view)]
    return "\n".join(lines)


def teardown(sb, dp) -> None:
    try:
        if dp is not None:
            dp.remove()
            dp.close()
    finally:
        sb.delete()


@click.command("demo")
@click.option("--qos-only", is_flag=True,
              help="the datapath alone: each tier's share of mixed iperf3 flows and an EF ping (no worker, no agent)")
@click.option("--rate", type=RATE, help="link rate of the sandbox node  [default: 20mbit; 100mbit with --qos-only]")
@click.option("--seconds", type=click.IntRange(4, 60),
              help="seconds of traffic (per phase in the full demo)  [default: 20; 8 with --qos-only]")
@click.option("--size", type=click.IntRange(32, 512), default=256, show_default=True, help="image size in pixels")
@click.option("--no-fault", is_flag=True, help="skip the stress-ng CPU fault")
@click.option("--json", "as_json", is_flag=True, help="print the full demo's results as JSON")
def command(qos_only, rate, seconds, size, no_fault, as_json):
    """Build a sandbox node (two network namespaces) and its client, run the worker (tiny model)
    and a mixed-tier load - image requests of every tier, bulk flows, a stress-ng CPU fault - twice:
    as a plain FIFO node without the agent, then with turbonode; compare what each tier saw.
    Needs root; takes about 2 x SECONDS + 40 s; cleans up after itself, also on Ctrl-C or SIGTERM."""
    if os.geteuid() != 0:
        raise click.ClickException("the demo needs root (network namespaces, tc, bpf)")
    previous = signal.signal(signal.SIGTERM, _interrupt_in(os.getpid()))
    try:
        if qos_only:
            qos_only_demo(rate or parse_rate("100mbit"), seconds or 8)
        else:
            full_demo(rate or parse_rate("20mbit"), seconds or 20, size, not no_fault, as_json)
    except TurbonodeError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; everything the demo started was removed") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt_in(owner: int):
    """A SIGTERM handler that cleans up like Ctrl-C (the demo's children run in their own sessions)
    in process `owner` only: a forked child (pyroute2's namespace helper) inherits Python's
    handlers, and must die of SIGTERM rather than run the demo's cleanup a second time."""
    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt
    return handler


def full_demo(rate: int, seconds: int, size: int, fault: bool, as_json: bool) -> None:
    from sandbox.node import DemoSettings, report as demo_report, run_demo  # pyroute2, psutil: only when run

    settings = DemoSettings(rate=format_rate(rate), duration=seconds, size=size, stress=fault)
    result = run_demo(settings, (lambda msg: click.echo(msg, err=True)) if as_json else click.echo)
    click.echo(json.dumps(result, indent=2) if as_json else "\n" + demo_report(result))


def qos_only_demo(rate: int, seconds: int) -> None:
    sb = dp = None
    try:
        sb = build_node()
        click.echo(f"sandbox node: netns {sb.server} ({sb.dev}) <-> netns {sb.client}; "
                   f"applying QoS at {format_rate(rate)}")
        dp = apply_qos(sb, rate)
        traffic = run_mixed_traffic(sb, seconds, rate)
        click.echo(report(dp.show(), traffic, rate))
    finally:
        if sb is not None:
            teardown(sb, dp)
