"""`turboctl agent run`: the host agent in the foreground (systemd runs it this way)."""

from __future__ import annotations

import click

from turbonode import logs
from turbonode.config import load_config
from turbonode.errors import ConfigError, TurbonodeError


@click.group("agent")
def command():
    """The host agent: watch for degradation, shape QoS, throttle the worker."""


@command.command("run")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")
@click.option("--dev", help="egress interface to shape (qos.dev)")
@click.option("--netns", help="network namespace of --dev (qos.netns)")
@click.option("--worker-socket", help="worker control socket (agent.worker_socket)")
@click.option("--socket", "agent_socket", help="the agent's own status socket (agent.socket)")
@click.option("--metrics", help="Prometheus endpoint HOST:PORT (agent.metrics)")
@click.option("--dry-run", is_flag=True, default=None, help="log what would be done; change nothing")
def run(config_file, dev, netns, worker_socket, agent_socket, metrics, dry_run):
    """Run the agent until SIGTERM/SIGINT."""
    from agent import daemon

    overrides = {
        "qos.dev": dev,
        "qos.netns": netns,
        "agent.worker_socket": worker_socket,
        "agent.socket": agent_socket,
        "agent.metrics": metrics,
        "agent.dry_run": dry_run,
    }
    try:
        cfg = load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None
    logs.show_lifecycle("turbonode")  # decisions and the datapath's state are logged at INFO
    try:
        raise SystemExit(daemon.run(cfg))
    except TurbonodeError as exc:
        raise click.ClickException(str(exc)) from None
