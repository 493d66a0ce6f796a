"""`turboctl demo`: a sandbox node under mixed-tier load and a fault, without and with turbonode."""

from __future__ import annotations

import json

import click

from turbonode.errors import TurbonodeError
from turbonode.rates import format_rate

from .params import RATE


@click.command("demo")
@click.option("--duration", type=click.FloatRange(3, 60), default=20.0, show_default=True,
              help="seconds of load in each of the two phases")
@click.option("--rate", type=RATE, default="20mbit", show_default=True, help="the sandbox node's link rate")
@click.option("--size", type=click.IntRange(32, 512), default=256, show_default=True, help="image size in pixels")
@click.option("--no-fault", is_flag=True, help="skip the stress-ng CPU fault")
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
def command(duration, rate, size, no_fault, as_json):
    """Build a sandbox node (two network namespaces), run the worker and a mixed-tier load with
    bulk traffic and a CPU fault twice - as a plain FIFO node, then with turbonode - and compare
    what each tier saw. Needs root; takes about 2 x DURATION + 30 s; cleans up, also on Ctrl-C."""
    from agent.demo import DemoSettings, report, run_demo  # pyroute2 and friends only when it runs

    settings = DemoSettings(rate=format_rate(rate), duration=duration, size=size, stress=not no_fault)
    log = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    try:
        result = run_demo(settings, log)
    except TurbonodeError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; everything the demo started was removed") from None
    click.echo(json.dumps(result, indent=2) if as_json else "\n" + report(result))
