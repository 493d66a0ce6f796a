"""`turboctl status`: the agent's level and why, QoS per tier, worker queues and throttle."""

from __future__ import annotations

import json
import time

import click

from agent.policy import describe_reason
from turbonode.config import load_config
from turbonode.errors import ConfigError, ControlError
from turbonode.jsonrpc import ControlClient
from turbonode.rates import format_rate
from turbonode.tiers import TIER_NAMES


def _reason(r: dict) -> str:
    return describe_reason(r["signal"], r.get("value"), r["threshold"], r.get("crossed", ""))


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _secs(v) -> str | None:
    return None if v is None else f"{v * 1000:.1f} ms"


def _rate(bps) -> str | None:
    return None if bps is None else format_rate(bps)


def render(st: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    out = [f"level:    {st['level']}"]
    change = st.get("last_change")
    if change:
        ago = now - change["at"] if change.get("at") else 0
        out.append(
            f"changed:  {change['from']} -> {change['to']} {ago:.0f} s ago: "
            + (", ".join(map(_reason, change["reasons"])) or "all signals healthy")
        )
    out.append("active:   " + (", ".join(map(_reason, st.get("active", []))) or "none"))
    acts = st.get("actions", {})
    applied = acts.get("applied", {})
    out.append(
        f"actions:  relax ceil {applied.get('relax_ceil_pct') or 'configured'}"
        f"{' %' if applied.get('relax_ceil_pct') else ''}, worker throttle {applied.get('throttle') or 'none'}"
        + ("  (dry-run)" if acts.get("dry_run") else "")
    )
    hold = acts.get("worker_hold")
    if hold is not None:
        out.append(f"hold:     the operator holds the worker ({hold.get('reason', '?')}): its throttle is left alone")
    watchers = st.get("watchers", {})
    bad = [f"{n}: {w['error']}" for n, w in watchers.items() if not w["ok"]]
    out.append("watchers: " + ("all ok" if not bad else "; ".join(bad)))
    softirq = watchers.get("softirq", {})
    if softirq.get("mode") == "procfs":
        out.append(f"softirq:  /proc/softirqs fallback, no latency ({softirq.get('bpf_error')})")
    dp = st.get("datapath")
    if dp:
        where = f"{dp['dev']} in netns {dp['netns']}" if dp.get("netns") else dp["dev"]
        out.append(
            f"datapath: {where}, HTB at {_rate(dp.get('rate_bps')) or '-'}, {dp.get('leaf_kind')} leaves, "
            f"classifier prog {dp.get('prog_id')}"
        )
    qos = st.get("qos") or {}
    if qos:
        out += ["", "QoS"] + _table(
            ["tier", "packets", "bytes", "drops", "backlog", "rate", "ceil"],
            [
                [
                    t,
                    q.get("packets"),
                    q.get("bytes"),
                    q.get("drops"),
                    q.get("backlog_bytes"),
                    _rate(q.get("rate_bps")),
                    _rate(q.get("ceil_bps")),
                ]
                for t, q in qos.items()
            ],
        )
    worker = st.get("worker", {})
    out += ["", f"worker:   {worker.get('state')}" + (f" ({worker['error']})" if worker.get("error") else "")]
    tiers = worker.get("tiers") or {}
    if tiers:
        out += _table(
            ["tier", "queued", "in flight", "oldest wait", "wait p99"],
            [
                [
                    t,
                    tiers[t].get("queued"),
                    tiers[t].get("in_flight"),
                    _secs(tiers[t].get("oldest_wait_s")),
                    _secs(tiers[t].get("queue_wait_p99_s")),
                ]
                for t in TIER_NAMES
                if t in tiers
            ],
        )
    thr = worker.get("throttle")
    if worker.get("state") == "ok":
        shown = {k: v for k, v in (thr or {}).items() if k != "hold" and v not in (None, [], {})}
        out.append(
            "throttle: "
            + ("none" if not thr else ", ".join(f"{k}={v}" for k, v in shown.items()))
            + ("  (operator hold)" if thr and thr.get("hold") else "")
        )
    return "\n".join(out)


@click.command("status")
@click.option("--socket", "path", help="agent status socket (default: agent.socket from the config)")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")
@click.option("--json", "as_json", is_flag=True, help="print the agent's status object as JSON")
@click.pass_context
def command(ctx, path, config_file, as_json):
    """Show the agent's degradation level and why, QoS per tier, worker queues and throttle."""
    if path is None:
        try:
            path = load_config(config_file).agent.socket
        except ConfigError as exc:
            raise click.ClickException(f"invalid configuration: {exc}") from None
    ctx.obj = ControlClient(path, peer="agent")
    try:
        st = ctx.obj.call("status")
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(st, indent=2, sort_keys=True) if as_json else render(st))
