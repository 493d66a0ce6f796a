"""`turboctl qos apply|show|remove|set-map|set-rate`: the QoS datapath of one interface."""

from __future__ import annotations

import functools
import json
import time

import click

from turbonode.config import load_config
from turbonode.errors import ConfigError, TurbonodeError
from turbonode.rates import describe_rate, format_rate, parse_rate
from turbonode.text import parse_decimal
from turbonode.tiers import TIER_NAMES

from .params import LINK_RATE, RATE, TIER


class DscpAssignment(click.ParamType):
    """DSCP=TIER, e.g. 46=turbo or 10=fast."""

    name = "DSCP=TIER"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text, sep, tier = str(value).partition("=")
        dscp = parse_decimal(text.strip())
        if not sep or dscp is None or not 0 <= dscp < 64:
            self.fail(f"{value!r}: expected DSCP=TIER with DSCP 0..63, e.g. 46=turbo", param, ctx)
        if tier not in TIER_NAMES:
            self.fail(f"{value!r}: unknown tier {tier!r} (expected one of {', '.join(TIER_NAMES)})", param, ctx)
        return dscp, tier


def _target(func):
    """--dev/--netns/--config on every subcommand; passes the QosConfig and a Datapath."""

    @click.option("--dev", help="interface to shape (default: qos.dev from the config)")
    @click.option("--netns", help="named network namespace of the interface")
    @click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        help="TOML configuration (default /etc/turbonode/turbonode.toml if present)",
    )
    @functools.wraps(func)
    def wrapper(dev, netns, config_file, **kw):
        try:
            cfg = load_config(config_file, overrides={"qos.dev": dev, "qos.netns": netns})
        except ConfigError as exc:
            raise click.ClickException(f"invalid configuration: {exc}") from None
        if not cfg.qos.dev:
            raise click.UsageError("no interface: pass --dev IF (or set qos.dev in the config)")
        from tc.datapath import Datapath  # pyroute2 only when a command runs

        try:
            with Datapath(cfg.qos.dev, cfg.qos.netns or None) as dp:
                return func(cfg.qos, dp, **kw)
        except TurbonodeError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


@click.group("qos")
def command():
    """eBPF DSCP classifier under an HTB tree: one class per tier."""


@command.command("apply")
@_target
@click.option(
    "--rate",
    type=LINK_RATE,
    help="link rate the root shapes to, in tc's units: 100mbit = 100 Mbit/s, 100mbps = 100 MB/s = 800 Mbit/s "
    "(default: qos.rate)",
)
def apply_cmd(qos, dp, rate):
    """Install or update the tree and classifier (idempotent); prints the link rate in bit/s."""
    result = dp.apply(qos, rate_bps=rate)
    how = "compiled and attached" if result["compiled"] else "already current"
    click.echo(
        f"{dp.dev}: link {describe_rate(rate or parse_rate(qos.rate))}; {result['changes']} change(s); "
        f"classifier {how} (prog id {result['prog_id']}); leaf queues {result['leaf_kind']}"
    )
    for what in ("classes", "filters"):
        if result[f"extra_{what}"]:
            click.echo(f"{dp.dev}: deleted {what} turbonode does not define: {', '.join(result[f'extra_{what}'])}")
    _report_stale(result["stale"])


def _report_stale(entries: list[str]) -> None:
    if entries:
        click.echo(f"cleaned the pins of deleted namespaces or devices: {', '.join(entries)}")


def _dscp_cell(codes: list[int]) -> str:
    return ",".join(map(str, codes)) if len(codes) <= 6 else f"others({len(codes)})"


def _num(v) -> str:
    return "-" if v is None else str(v)


def describe_limit(tier: str, limit: dict, now: float) -> str:
    """Whether a tier's leased limit is in force and until when (`qos show`, `turboctl status`,
    after "limit: "); `now` is wall-clock time."""
    until = limit.get("until")
    if not until:
        return f"{tier} none in force"
    at = time.strftime("%H:%M:%S", time.localtime(until))
    if limit.get("in_force"):
        return (
            f"{tier} ceil {format_rate(limit['ceil_bps'])} in force until {at} "
            f"({max(0.0, until - now):.1f} s left unless the agent renews it; class {limit['class']})"
        )
    return f"{tier} none in force (the last one lapsed at {at}, {max(0.0, now - until):.0f} s ago)"


def format_table(view: dict, now: float | None = None) -> str:
    """The per-tier table `qos show` and `turboctl demo` print."""
    head = ("tier", "class", "dscp", "packets", "bytes", "htb_sent", "drops", "backlog", "borrowed", "rate", "ceil")
    rows = [head]
    for name in TIER_NAMES:
        r = view["tiers"][name]
        rows.append(
            (
                name,
                r["class"],
                _dscp_cell(r["dscp"]),
                _num(r["packets"]),
                _num(r["bytes"]),
                _num(r["htb_sent_bytes"]),
                _num(r["drops"]),
                _num(r["backlog_bytes"]),
                _num(r["borrowed"]),
                format_rate(r["rate_bps"]) if r["rate_bps"] else "-",
                format_rate(r["ceil_bps"]) if r["ceil_bps"] else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    u = view["tiers"]["unparsed"]
    where = f"{view['dev']}" + (f" (netns {view['netns']})" if view["netns"] else "")
    lines.insert(
        0,
        f"{where}: link {describe_rate(view['rate_bps'])}, leaf queues {view['leaf_kind']}, "
        f"classifier prog id {view['prog_id']}",
    )
    lines.append(f"unparsed frames (sent to 'other'): {u['packets']} packets, {u['bytes']} bytes")
    now = time.time() if now is None else now
    lines += [
        "limit: " + describe_limit(t, view["tiers"][t]["limit"], now)
        for t in TIER_NAMES
        if view["tiers"][t].get("limit")
    ]
    return "\n".join(lines)


@command.command("show")
@_target
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def show_cmd(qos, dp, as_json):
    """Per tier: classifier packets/bytes, HTB sent, drops, backlog, borrowed."""
    view = dp.show()
    click.echo(json.dumps(view, indent=2) if as_json else format_table(view))


@command.command("remove")
@_target
def remove_cmd(qos, dp):
    """Remove the tree and classifier; the kernel's default root qdisc comes back. With the
    device or namespace gone, clean the pins it left."""
    r = dp.remove()
    _report_stale(r["stale"])
    if r["stale"]:
        return
    if not r["removed"]:
        click.echo(f"{dp.dev}: no turbonode QoS to remove (root qdisc {r['root']})")
        return
    click.echo(f"{dp.dev}: removed; root qdisc is {r['root']} again")
    if not r["restored"]:
        raise click.ClickException(f"root qdisc is {r['root']}, not the kernel's default")


@command.command("set-map")
@_target
@click.argument("assignments", nargs=-1, required=True, type=DscpAssignment())
def set_map_cmd(qos, dp, assignments):
    """Steer DSCP values to tiers in the live classifier, e.g. `set-map 10=fast 0=relax`."""
    dp.set_map(dict(assignments))
    click.echo(f"{dp.dev}: " + ", ".join(f"DSCP {d} -> {t}" for d, t in assignments))


@command.command("set-rate")
@_target
@click.argument("tier", type=TIER)
@click.argument("rate", type=RATE)
@click.argument("ceil", type=RATE, required=False)
def set_rate_cmd(qos, dp, tier, rate, ceil):
    """Change a tier's guaranteed RATE (and CEIL) in place, e.g. `set-rate relax 5mbit 20mbit`."""
    r = dp.set_rate(tier, rate, ceil)
    click.echo(f"{dp.dev}: {tier} rate {format_rate(r['rate_bps'])} ceil {format_rate(r['ceil_bps'])}")
