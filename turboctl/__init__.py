"""turboctl: admin CLI for the agent and the worker.

Each command group lives in its own module and is registered here. Commands that need
torch import it lazily, so `turboctl qos ...` never loads it.
"""

from __future__ import annotations

import logging

import click

from turbonode import __version__

from . import agent_cmd, config_cmd, demo_cmd, qos_cmd, render_cmd, status_cmd, worker_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="turboctl")
@click.option("-v", "--verbose", count=True, help="more logging (-v info, -vv debug)")
def main(verbose):
    """Keep the turbo tier of an image-generation node fast under load."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


for _module in (config_cmd, demo_cmd, qos_cmd, agent_cmd, status_cmd, worker_cmd, render_cmd):
    for _command in getattr(_module, "commands", (_module.command,)):
        main.add_command(_command)
