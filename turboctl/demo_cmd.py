"""`turboctl demo`: a sandbox node under mixed-tier load, without and with turbonode.

The full demo (sandbox/demo.py) runs the worker, the agent, tiered image requests, bulk flows and
a CPU fault twice and compares what each tier saw. `--qos-only` shows the datapath alone
(sandbox/traffic.py). This module only parses options and prints.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import click

from turbonode.errors import TurbonodeError
from turbonode.rates import format_rate, parse_rate

from .params import LINK_RATE
from .qos_cmd import format_table


@click.command("demo")
@click.option(
    "--qos-only",
    is_flag=True,
    help="the datapath alone: each tier's share of mixed iperf3 flows and an EF ping (no worker, no agent)",
)
@click.option(
    "--rate", type=LINK_RATE, help="link rate of the sandbox node  [default: 20mbit; 100mbit with --qos-only]"
)
@click.option(
    "--seconds",
    type=click.IntRange(4, 60),
    help="seconds of traffic (per phase in the full demo)  [default: 20; 8 with --qos-only]",
)
@click.option("--size", type=click.IntRange(32, 512), default=256, show_default=True, help="image size in pixels")
@click.option("--no-fault", is_flag=True, help="skip the stress-ng CPU fault")
@click.option(
    "--workers",
    type=click.IntRange(1, 8),
    default=1,
    show_default=True,
    help="workers on the node, as a multi-GPU node runs them ([workers.a], [workers.b], ...), each under load",
)
@click.option("--json", "as_json", is_flag=True, help="print the full demo's results as JSON")
@click.option(
    "--keep-logs", is_flag=True, help="keep the worker's and the agent's logs and the node's config; prints where"
)
def command(qos_only, rate, seconds, size, no_fault, workers, as_json, keep_logs):
    """Build a sandbox node (two network namespaces) and its client, run the worker (tiny model)
    and a mixed-tier load - open-loop turbo requests and closed-loop clients of the other tiers, bulk
    flows, a stress-ng CPU fault - twice (the short form of bench/node_slo.py):
    as a plain FIFO node without the agent, then with turbonode; compare what each tier saw.
    With --workers N the node runs N workers under one agent (each its own port, socket and cgroup, and
    a CPU of its own while there are enough), each under the same load.
    Needs root; takes about 2 x SECONDS + 40 s; cleans up after itself, also on Ctrl-C or SIGTERM."""
    if os.geteuid() != 0:
        raise click.ClickException("the demo needs root (network namespaces, tc, bpf)")
    stop = threading.Event()
    handler = _interrupt_in(os.getpid(), stop)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if qos_only:
            qos_only_demo(rate or parse_rate("100mbit"), seconds or 8, stop)
        else:
            full_demo(
                rate or parse_rate("20mbit"), seconds or 20, size, not no_fault, as_json, keep_logs, stop, workers
            )
    except TurbonodeError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; everything the demo started was removed") from None
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupt_in(owner: int, stop: threading.Event | None = None):
    """A SIGTERM/SIGINT handler that cleans up like Ctrl-C (the demo's children run in their own
    sessions) in process `owner` only: a forked child (pyroute2's namespace helper) inherits
    Python's handlers, and must die of the signal rather than run the demo's cleanup a second
    time. It also sets `stop`, which the demo checks at every step: a KeyboardInterrupt raised
    inside a library that swallows it (pyroute2) once let the demo run on into its second phase."""

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if stop is not None:
            stop.set()
        raise KeyboardInterrupt

    return handler


def full_demo(
    rate: int,
    seconds: int,
    size: int,
    fault: bool,
    as_json: bool,
    keep_logs: bool = False,
    stop: threading.Event | None = None,
    workers: int = 1,
) -> None:
    from sandbox import report  # pyroute2, psutil: only when run
    from sandbox.demo import run_demo
    from sandbox.settings import DemoSettings

    settings = DemoSettings(
        rate=format_rate(rate), duration=seconds, size=size, stress=fault, keep_logs=keep_logs, workers=workers
    )
    result = run_demo(settings, (lambda msg: click.echo(msg, err=True)) if as_json else click.echo, stop)
    click.echo(json.dumps(result, indent=2) if as_json else "\n" + report.comparison(result))


def qos_only_demo(rate: int, seconds: int, stop: threading.Event | None = None) -> None:
    from sandbox import report
    from sandbox.traffic import run_qos_only

    view, traffic = run_qos_only(rate, seconds, click.echo, stop)
    click.echo("\n".join([report.traffic(traffic, rate), "", "turboctl qos show:", format_table(view)]))
