"""`turboctl status`: the agent's level and why, QoS per tier, and every worker of the node: its
readiness, queues and throttle, and the agent's view of it (its level and why, the throttle sent)."""

from __future__ import annotations

import json
import time

import click

from agent.policy import describe_reason
from turbonode.config import DEFAULT_WORKER, Config, instance_worker, load_config, node_workers
from turbonode.errors import ConfigError, ControlError
from turbonode.jsonrpc import WORKER_LOADING, ControlClient
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


def _change(change: dict | None, now: float) -> list[str]:
    if not change:
        return []
    ago = now - change["at"] if change.get("at") else 0
    return [
        f"changed:  {change['from']} -> {change['to']} {ago:.0f} s ago: "
        + (", ".join(map(_reason, change["reasons"])) or "all signals healthy")
    ]


def _levers(levers: dict | None) -> list[str]:
    shown = {name: lever for name, lever in (levers or {}).items() if isinstance(lever, dict) and name != "writer"}
    out = ["levers:   " + "; ".join(_lever(name, lever) for name, lever in shown.items())] if shown else []
    return out + _writer((levers or {}).get("writer"))


def _writer(writer: dict | None) -> list[str]:
    """Who applies the node's levers and why: 'writer:   systemd (PID 1 is systemd: ...); worker a:
    unit turbonode-worker@a.service, through systemd'."""
    if not isinstance(writer, dict):
        return []
    workers = [
        f"worker {n}: "
        + (f"unit {w['unit']}, " if w.get("unit") else f"cgroup {w.get('cgroup')}, ")
        + str(w["through"])
        for n, w in (writer.get("workers") or {}).items()
    ]
    return [f"writer:   {writer.get('backend')} ({writer.get('why')})" + "".join(f"; {w}" for w in workers)]


def render_agent(st: dict, now: float | None = None) -> list[str]:
    """The agent's level and why, the node's actions, watchers and QoS per tier (each worker's
    part of it: render_agent_worker)."""
    now = time.time() if now is None else now
    node = st.get("node") or {}
    out = [
        f"level:    {st['level']}"
        + (f" (node {node['level']})" if node.get("level", st["level"]) != st["level"] else "")
    ]
    out += _change(st.get("last_change"), now)
    out.append("active:   " + (", ".join(map(_reason, st.get("active", []))) or "none"))
    acts = st.get("actions", {})
    applied = acts.get("applied", {})
    out.append(
        f"actions:  relax ceil {applied.get('relax_ceil_pct') or 'configured'}"
        f"{' %' if applied.get('relax_ceil_pct') else ''}" + ("  (dry-run)" if acts.get("dry_run") else "")
    )
    out += _levers(acts.get("levers"))
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


def render_agent_worker(seen: dict, now: float) -> list[str]:
    """The agent's view of one worker: its level and why, the throttle it sent, its levers."""
    out = [
        f"agent:    level {seen.get('level')}: "
        + (", ".join(map(_reason, seen.get("active", []))) or "all signals healthy")
        + (f"; throttle sent {seen['sent']}" if seen.get("sent") else "")
    ]
    if seen.get("throttle_error"):
        out.append(f"          its throttle failed: {seen['throttle_error']}")
    hold = seen.get("hold")
    if hold is not None:
        out.append(f"hold:     the operator holds the worker ({hold.get('reason', '?')}): its throttle is left alone")
    return out + [f"  {line}" for line in _change(seen.get("last_change"), now)] + _levers(seen.get("levers"))


def render_worker_part(name: str, worker: dict, seen: dict | None, now: float) -> list[str]:
    """One worker: what it says (or why it does not answer), and what the agent makes of it."""
    if "error" not in worker:
        backend = worker.get("backend") or {}
        out = [
            f"worker {name}: ok ({worker['_socket']}): backend {backend.get('name')} on {backend.get('device')}, "
            f"up {worker.get('uptime_s', 0):.0f} s"
        ]
        out += render_worker(worker)
    else:
        # bound but still loading its model: it answers, and says so
        state = "loading" if WORKER_LOADING in worker["error"] else "unreachable"
        out = [f"worker {name}: {state}: {worker['error']}"]
        if seen:  # the agent's last sample of the worker, with the agent's view of why
            out.append(
                f"          the agent sees it {seen.get('state')}"
                + (f" ({seen['error']})" if seen.get("error") else "")
            )
            out += render_worker(seen)
    return out + (render_agent_worker(seen, now) if seen else [])


def render(agent: dict, workers: dict[str, dict], now: float | None = None) -> str:
    """Each part and what it says; an unreachable part says why, and the rest still shows."""
    now = time.time() if now is None else now
    out = []
    if "error" in agent:
        out.append(f"agent:    unreachable: {agent['error']}")
    else:
        out.append(f"agent:    ok ({agent['_socket']})")
        out += render_agent(agent, now)
    seen = agent.get("workers") or {}
    for name, worker in workers.items():
        out += ["", *render_worker_part(name, worker, seen.get(name), now)]
    return "\n".join(out)


def _ask(path: str, peer: str) -> dict:
    try:
        return {**ControlClient(path, peer=peer).call("status"), "_socket": path}
    except ControlError as exc:
        return {"error": str(exc), "_socket": path}


def node_sockets(cfg: Config, worker_socket: str | None, only: str | None) -> dict[str, str]:
    """Worker name -> control socket: the node's workers (the only one's is worker.control_socket),
    or the one --worker names; --worker-socket instead names a socket (shown under `only` or
    the node's single worker's name)."""
    if worker_socket is not None:
        return {only or DEFAULT_WORKER: worker_socket}
    sockets = {}
    for spec in node_workers(cfg):
        if only in (None, spec.name):
            sockets[spec.name] = instance_worker(cfg, spec.name if cfg.workers else None)[0].control_socket
    if not sockets:
        raise click.ClickException(
            f"--worker {only}: not a worker of this node ({', '.join(w.name for w in node_workers(cfg))})"
        )
    return sockets


@click.command("status")
@click.option("--socket", "path", help="agent status socket (default: agent.socket from the config)")
@click.option("--worker", "only", metavar="NAME", help="show this worker of the node only (default: every one)")
@click.option(
    "--worker-socket", help="a worker's control socket (default: each worker's, from the config: [workers.<name>])"
)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML configuration file")
@click.option("--json", "as_json", is_flag=True, help='print {"agent": ..., "workers": {NAME: ...}} as JSON')
def command(path, only, worker_socket, config_file, as_json):
    """Show what each part of the node says: the agent (levels and why, actions, QoS per tier) and
    every worker (readiness per tier, queues, throttle; the agent's level and throttle for it). A part
    that does not answer is shown as unreachable, with why, and the exit status is 1."""
    try:
        cfg = load_config(config_file)
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from None
    agent = _ask(path or cfg.agent.socket, "agent")
    workers = {name: _ask(sock, "worker") for name, sock in node_sockets(cfg, worker_socket, only).items()}
    if as_json:
        parts = {
            "agent": {k: v for k, v in agent.items() if k != "_socket"},
            "workers": {n: {k: v for k, v in w.items() if k != "_socket"} for n, w in workers.items()},
        }
        click.echo(json.dumps(parts, indent=2, sort_keys=True))
    else:
        click.echo(render(agent, workers))
    if "error" in agent or any("error" in w for w in workers.values()):
        raise SystemExit(1)


def _lever(name: str, lever: dict) -> str:
    """'cpu_share engaged (cpu_load=0.93 > 0.75)', 'worker_threads off' or 'cpu_share off: <error>';
    a lever the host gives only in part says what it does instead ('[throttle: no proportional ...]')."""
    policy = lever.get("io_policy")
    note = f" [{policy.get('mode')}: {policy.get('summary')}]" if isinstance(policy, dict) else ""
    if not isinstance(policy, dict) or policy.get("mode") == "weight":
        note = ""  # the lever is what it says
    if lever.get("engaged"):
        return f"{name} engaged ({lever.get('reason')}){note}"
    if lever.get("error"):
        return f"{name} off: {lever['error']}"
    return f"{name} off{note}"
