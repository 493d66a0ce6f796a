"""`turboctl worker run|status|ping`, `turboctl throttle`, `turboctl release`.

`worker run` serves the worker's front, which never loads torch; its engine process does
(render/engine/host.py). The control commands talk to the worker's socket through a ControlClient
kept in the click context object (`--socket` or a caller-provided obj chooses it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import click

from turbonode import logs
from turbonode.config import BACKEND_NAMES, TINY_MODELS, instance_worker, load_config
from turbonode.config.loader import CLI_ENV_WORKER_SOCKET
from turbonode.errors import ConfigError, ControlError, TurbonodeError
from turbonode.jsonrpc import DEFAULT_SOCKET, ControlClient

from .params import TIER, TIER_STEPS, json_option

THROTTLE_TTL_S = 60.0
HOLD_TTL_S = 3600.0  # an operator's hold outlasts an incident's first hour unless released


def worker_client(obj, socket_path: str | None, worker: str | None, config_file: str | None) -> ControlClient:
    """The worker's control socket: --socket, else --worker's in the configuration, else a client
    the caller put in the context (tests), else the configuration's only worker."""
    if socket_path is not None:
        return ControlClient(socket_path)
    if worker is None and config_file is None and isinstance(obj, ControlClient):
        return obj
    try:
        cfg, _spec = instance_worker(load_config(config_file), worker)
    except ConfigError as exc:
        raise click.ClickException(f"{exc} (--worker NAME picks one, --socket PATH names a socket)") from None
    return ControlClient(cfg.control_socket)


def control_command(f):
    """--socket, --worker, --config and --json; the command receives the ControlClient first."""

    @click.option(
        "--socket",
        "socket_path",
        envvar=CLI_ENV_WORKER_SOCKET,
        metavar="PATH",
        help=f"the worker's control socket (default: --worker's, or the node's only worker's: {DEFAULT_SOCKET})",
    )
    @click.option("--worker", metavar="NAME", help="which of the node's workers ([workers.NAME] in the configuration)")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")
    @json_option
    @click.pass_context
    @functools.wraps(f)
    def command(ctx, *args, socket_path, worker, config_file, **kwargs):
        return f(worker_client(ctx.obj, socket_path, worker, config_file), *args, **kwargs)

    return command


def _call(client: ControlClient, method: str, **params):
    try:
        return client.call(method, **params)
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None


# ---- worker ----------------------------------------------------------------------------


@click.group("worker")
def command():
    """Run and inspect the diffusion worker."""


@command.command("run")
@click.option(
    "--instance",
    metavar="NAME",
    help="which of the node's workers ([workers.NAME]: its socket, address, device, CPUs; the unit's %i)",
)
@click.option("--model", help=f"a local diffusers directory, or an embedded test model: {', '.join(TINY_MODELS)}")
@click.option("--listen", metavar="HOST:PORT", help="HTTP API address (default 0.0.0.0:8460)")
@click.option("--control", metavar="PATH", help="control socket path")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")
@click.option("--backend", type=click.Choice(BACKEND_NAMES), help="denoiser/VAE backend")
@click.option("--device", help="torch device: auto, cpu, cuda, cuda:N")
def run(instance, model, listen, control, config_file, backend, device):
    """Serve the OpenAI-compatible image API and the control socket until SIGTERM."""
    flags = {"listen": listen, "control_socket": control, "device": device}
    overrides = {f"worker.{k}": v for k, v in {**flags, "model": model, "backend": backend}.items()}
    try:
        full = load_config(config_file, overrides=overrides)  # checks the flags as the file's keys
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None
    try:
        cfg, spec = instance_worker(full, instance)
    except ConfigError as exc:
        raise click.ClickException(f"{exc} (--instance NAME picks one)") from None
    cfg = dataclasses.replace(cfg, **{k: v for k, v in flags.items() if v is not None})  # over the instance's
    from render.front import daemon

    logs.show_lifecycle("render", "turbonode")  # model load, engine builds, serving, drain, throttles
    try:
        rc = daemon.run(cfg, node=full.node.name, name=spec.name, cpus=spec.cpus)
    except TurbonodeError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(rc)


@command.command("ping")
@control_command
def ping(client, as_json):
    """Check that the worker answers on its control socket."""
    result = _call(client, "ping")
    click.echo(json.dumps(result) if as_json else f"pong from pid {result.get('pid')}")


def _fmt_s(v):
    return "-" if v is None else f"{v * 1000:.1f} ms"


@command.command("status")
@control_command
def status(client, as_json):
    """Queues, step times, GC pauses, memory and the throttle in force."""
    st = _call(client, "status")
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    model = st.get("model") or {}
    click.echo(
        f"model {model.get('model')} ({model.get('family')} family, {model.get('pipeline')}), "
        f"backend {st['backend'].get('name')} on {st['backend'].get('device')}, "
        f"max batch {st['max_batch']}, up {st['uptime_s']:.0f} s"
    )
    click.echo(f"{'tier':<6} {'queued':>6} {'running':>7} {'oldest wait':>12} {'wait p99':>10}")
    for tier, t in st["tiers"].items():
        click.echo(
            f"{tier:<6} {t['queued']:>6} {t['in_flight']:>7} {_fmt_s(t['oldest_wait_s']):>12} "
            f"{_fmt_s(t['queue_wait_p99_s']):>10}"
        )
    if st.get("ready"):
        click.echo("ready: " + ", ".join(f"{t} {r['status']}" for t, r in st["ready"].items()))
    s = st["step_time_s"]
    click.echo(f"step: last {_fmt_s(s['last'])}, p50 {_fmt_s(s['p50'])}, p99 {_fmt_s(s['p99'])}")
    gc = st["gc"]
    click.echo(f"gc: {gc['collections_total']} collections, {gc['pause_seconds_total'] * 1000:.1f} ms paused")
    click.echo(f"memory: rss {st['memory']['rss_bytes'] / 2**20:.0f} MiB")
    t = st["throttle"]
    click.echo(
        "throttle: none"
        if t is None
        else f"throttle: {t['reason']} (max batch {t['max_batch']}, paused {t['paused_tiers']}, "
        f"caps {t['step_caps']}, shed {t['shed_tiers']}, unready {t['unready_tiers']}; "
        f"expires in {t['expires_in_s']:.1f} s)"
        + ("; operator hold: the agent does not change it" if t.get("hold") else "")
    )


# ---- throttle / release ----------------------------------------------------------------


@click.command("throttle")
@click.option("--max-batch", type=click.IntRange(min=1), help="largest UNet batch")
@click.option("--pause", "paused", type=TIER, multiple=True, help="tier whose jobs wait (repeatable)")
@click.option("--step-cap", "caps", type=TIER_STEPS, multiple=True, help="TIER=STEPS cap for new jobs (repeatable)")
@click.option("--shed", "shed", type=TIER, multiple=True, help="tier whose new jobs get 429 (repeatable)")
@click.option(
    "--unready",
    "unready",
    type=TIER,
    multiple=True,
    help="tier the worker reports not ready, so a balancer sends it elsewhere; turbo allowed (repeatable)",
)
@click.option(
    "--threads", type=click.IntRange(min=1), help="torch intra-op threads while it lasts (at most the configured)"
)
@click.option("--reason", required=True, help="why (logged, shown in status)")
@click.option(
    "--hold",
    is_flag=True,
    help="an operator hold: the agent does not replace or release it until `turboctl release` or expiry",
)
@click.option(
    "--ttl",
    type=click.FloatRange(min=0, min_open=True),
    help=f"seconds until the throttle expires unless set again [default: {THROTTLE_TTL_S:g}, "
    f"with --hold {HOLD_TTL_S:g}]",
)
@control_command
def throttle(client, max_batch, paused, caps, shed, unready, threads, reason, hold, ttl, as_json):
    """Throttle the worker's lower tiers (turbo cannot be throttled, only reported not ready); it expires
    after --ttl."""
    params = {"hold": True} if hold else {}  # only an operator's hold says so on the wire
    result = _call(
        client,
        "throttle",
        max_batch=max_batch,
        paused_tiers=list(paused),
        step_caps=dict(caps),
        shed_tiers=list(shed),
        unready_tiers=list(unready),
        intra_op_threads=threads,
        reason=reason,
        ttl_s=ttl or (HOLD_TTL_S if hold else THROTTLE_TTL_S),
        **params,
    )
    what = "held" if hold else "throttled"
    click.echo(json.dumps(result) if as_json else f"{what} ({reason}); expires in {result['expires_in_s']:.1f} s")


@click.command("release")
@click.option("--reason", default="", help="why (logged)")
@control_command
def release(client, reason, as_json):
    """Lift the worker's throttle now, an operator hold included."""
    result = _call(client, "release", reason=reason, hold=True)
    text = "released the operator hold" if result.get("hold") else "released" if result["released"] else None
    click.echo(json.dumps(result) if as_json else text or "no throttle was set")


commands = (command, throttle, release)
