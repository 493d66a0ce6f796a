"""turboctl: admin CLI for the agent and the worker.

Each command group lives in its own module and is registered here. Commands that need
torch import it lazily, so `turboctl qos ...` never loads it.
"""

from __future__ import annotations

import io
import logging
import sys

import click

from turbonode import __version__, logs

from . import agent_cmd, config_cmd, demo_cmd, doctor, keys_cmd, qos_cmd, render_cmd, status_cmd, worker_cmd


class Turboctl(click.Group):
    """The command group; under systemd, a command's "Error: ..." reaches the journal at
    priority err (turbonode/logs.py), like the daemons' logged errors."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            if not logs.stream_is_journal(sys.stderr):
                raise
            shown = io.StringIO()
            exc.show(file=shown)
            click.echo(logs.prefix_lines(shown.getvalue().rstrip("\n"), logs.ERR), err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=Turboctl, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="turboctl")
@click.option("-v", "--verbose", count=True, help="more logging (-v info, -vv debug)")
def main(verbose):
    """Keep the turbo tier of an image-generation node fast under load."""
    logs.setup(logging.WARNING - 10 * min(verbose, 2))


for _module in (config_cmd, demo_cmd, doctor, qos_cmd, agent_cmd, status_cmd, worker_cmd, render_cmd, keys_cmd):
    for _command in getattr(_module, "commands", (_module.command,)):
        main.add_command(_command)
