"""`turboctl config check|example`: validate the TOML file naming the bad key; print the defaults."""

from __future__ import annotations

import json

import click

from turbonode.config import DEFAULT_PATH, as_dict, load_config
from turbonode.config_example import render_example
from turbonode.errors import ConfigError


@click.group("config")
def command():
    """Inspect and validate the configuration file."""


@command.command("check")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the effective configuration as JSON")
def check(file, as_json):
    """Validate FILE (default /etc/turbonode/turbonode.toml); exit 1 naming the bad key."""
    try:
        cfg = load_config(file)
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None
    if as_json:
        click.echo(json.dumps(as_dict(cfg), indent=2))
    else:
        click.echo(f"{file or DEFAULT_PATH}: OK")


@command.command("example")
def example():
    """Print a configuration file with every key at its default, with help comments."""
    click.echo(render_example(), nl=False)
