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

from .qos_cmd import describe_limit


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


def render_agent(st: dict, now: float | None = None) -> list[str]:
    """The agent's level and why, its actions, watchers and QoS per tier."""
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
    levers = {name: lever for name, lever in (acts.get("levers") or {}).items() if isinstance(lever, dict)}
    if levers:
        out.append("levers:   " + "; ".join(_lever(name, lever) for name, lever in levers.items()))
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
        out += ["limit:    " + describe_limit(t, q["limit"], now) for t, q in qos.items() if q.get("limit")]
    return out


def render_worker(worker: dict) -> list[str]:
    """Readiness, queues per tier and the throttle, from the worker's status (its own or the agent's copy)."""
    out = []
    ready = worker.get("ready") or {}
    if ready:
        out.append(
            "ready:    "
            + ", ".join(
                f"{t} {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "") for t, r in ready.items()
            )
        )
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
    if tiers or "throttle" in worker:
        thr = worker.get("throttle")
        shown = {k: v for k, v in (thr or {}).items() if k != "hold" and v not in (None, [], {})}
        out.append(
            "throttle: "
            + ("none" if not thr else ", ".join(f"{k}={v}" for k, v in shown.items()))
            + ("  (operator hold)" if thr and thr.get("hold") else "")
        )
    return out


def render(agent: dict, worker: dict, now: float | None = None) -> str:
    """Each part and what it says; an unreachable part says why, and the rest still shows."""
    out = []
    if "error" in agent:
        out.append(f"agent:    unreachable: {agent['error']}")
    else:
        out.append(f"agent:    ok ({agent['_socket']})")
        out += render_agent(agent, now)
    out.append("")
    if "error" not in worker:
        backend = worker.get("backend") or {}
        out.append(
            f"worker:   ok ({worker['_socket']}): backend {backend.get('name')} on {backend.get('device')}, "
            f"up {worker.get('uptime_s', 0):.0f} s"
        )
        out += render_worker(worker)
    else:
        # bound but still loading its model: it answers, and says so
        state = "loading" if "loading its model" in worker["error"] else "unreachable"
        out.append(f"worker:   {state}: {worker['error']}")
        seen = agent.get("worker")
        if seen:  # the agent's last sample of the worker, with the agent's view of why
            out.append(
                f"          the agent sees it {seen.get('state')}"
                + (f" ({seen['error']})" if seen.get("error") else "")
            )
            out += render_worker(seen)
    return "\n".join(out)


def _ask(path: str, peer: str) -> dict:
    try:
        return {**ControlClient(path, peer=peer).call("status"), "_socket": path}
    except ControlError as exc:
        return {"error": str(exc), "_socket": path}


@click.command("status")
@click.option("--socket", "path", help="agent status socket (default: agent.socket from the config)")
@click.option("--worker-socket", help="worker control socket (default: worker.control_socket from the config)")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")
@click.option("--json", "as_json", is_flag=True, help='print {"agent": ..., "worker": ...} as JSON')
def command(path, worker_socket, config_file, as_json):
    """Show what each part of the node says: the agent (level and why, actions, QoS per tier) and the
    worker (readiness per tier, queues, throttle). A part that does not answer is shown as unreachable,
    with why, and the exit status is 1."""
    if path is None or worker_socket is None:
        try:
            cfg = load_config(config_file)
        except ConfigError as exc:
            raise click.ClickException(f"invalid configuration: {exc}") from None
        path = path or cfg.agent.socket
        worker_socket = worker_socket or cfg.worker.control_socket
    agent, worker = _ask(path, "agent"), _ask(worker_socket, "worker")
    if as_json:
        parts = {
            name: {k: v for k, v in part.items() if k != "_socket"}
            for name, part in (("agent", agent), ("worker", worker))
        }
        click.echo(json.dumps(parts, indent=2, sort_keys=True))
    else:
        click.echo(render(agent, worker))
    if "error" in agent or "error" in worker:
        raise SystemExit(1)


def _lever(name: str, lever: dict) -> str:
    """'cpu_share engaged (cpu_load=0.93 > 0.75)', 'worker_threads off' or 'cpu_share off: <error>'."""
    if lever.get("engaged"):
        return f"{name} engaged ({lever.get('reason')})"
    return f"{name} off" + (f": {lever['error']}" if lever.get("error") else "")
