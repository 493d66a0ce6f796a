"""`turboctl config check|example|workers`: validate the TOML file naming the bad key; print the
defaults; list the node's workers (what systemd starts: turbonode-worker@<name>)."""

from __future__ import annotations

import json

import click

from turbonode import config
from turbonode.accounts import load_keys, parse_period
from turbonode.config import load_config, node_workers
from turbonode.config.loader import as_dict
from turbonode.config_example import render_example
from turbonode.errors import ConfigError


@click.group("config")
def command():
    """Inspect and validate the configuration file."""


@command.command("check")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the effective configuration as JSON")
def check(file, as_json):
    """Validate FILE (default /etc/turbonode/turbonode.toml), the TURBONODE_* environment and the
    keys file it names (worker.keys_file); exit 1 naming the bad key."""
    source = config.config_path(file)
    try:
        cfg = load_config(source)
        if cfg.worker.keys_file:  # the worker refuses to start on a bad one: say so here
            load_keys(cfg.worker.keys_file, parse_period(cfg.worker.budget_period))
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None
    if as_json:
        click.echo(json.dumps(as_dict(cfg), indent=2))
    elif source is None:
        click.echo(f"{config.DEFAULT_PATH} does not exist: the daemons run on the defaults (and the environment)")
    else:
        click.echo(f"{source}: OK")


@command.command("example")
def example():
    """Print a configuration file with every key at its default, with help comments."""
    click.echo(render_example(), nl=False)


WORKER_UNIT = "turbonode-worker@{}.service"  # systemd/turbonode-worker@.service, one instance per worker


@command.command("workers")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--units", is_flag=True, help="print each worker's systemd unit (turbonode-worker@NAME.service)")
@click.option("--json", "as_json", is_flag=True, help="print each worker's resolved settings as JSON")
def workers(file, units, as_json):
    """List the node's workers, one name a line ([workers.<name>]; a file naming none has one, default):
    `systemctl enable --now $(turboctl config workers --units)` starts them all."""
    try:
        specs = node_workers(load_config(config.config_path(file)))
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None
    if as_json:
        click.echo(json.dumps({s.name: {**as_dict(s), "cpus": sorted(s.cpus)} for s in specs}, indent=2))
        return
    for spec in specs:
        click.echo(WORKER_UNIT.format(spec.name) if units else spec.name)
