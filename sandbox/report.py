"""Text reports of what each tier saw in the sandbox: the full demo's side-by-side comparison
and the datapath-only traffic summary."""

from __future__ import annotations

from turbonode.rates import format_rate
from turbonode.tiers import TIER_NAMES


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def comparison(result: dict) -> str:
    """The full demo's per-tier comparison, without and with turbonode side by side: the figures
    bench/node_slo.py reports per cell (sandbox.loadgen.summarize)."""
    head = f"{'ok/sent':>8} {'refused':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'img/s':>5}"
    width = len(head)
    lines = [f"{'':6}  {'without turbonode':^{width}}  {'with turbonode':^{width}}", f"{'tier':6}  {head}  {head}"]
    a, b = result["without"]["tiers"], result["with"]["tiers"]
    empty = {"ok": 0, "requests": 0, "rejected": 0, "failed": 0, "p50_s": None, "p99_s": None, "max_s": None}
    for tier in [t for t in TIER_NAMES if t in a or t in b]:
        cells = []
        for s in (a.get(tier, empty), b.get(tier, empty)):
            rate = s.get("images_per_s")
            cells.append(
                f"{s['ok']:>3}/{s['requests']:<4} {s['rejected'] + s['failed']:>7} {_ms(s['p50_s']):>7} "
                f"{_ms(s['p99_s']):>7} {_ms(s.get('max_s')):>7} {'-' if rate is None else f'{rate:.2f}':>5}"
            )
        lines.append(f"{tier:6}  {cells[0]}  {cells[1]}")
    per_worker = result["with"].get("workers") or {}
    if len(per_worker) > 1:  # turbo at each worker: the load ran at every one
        lines.append("")
        for name in per_worker:
            cells = []
            for phase in ("without", "with"):
                t = (result[phase].get("workers") or {}).get(name, {}).get("turbo") or empty
                cells.append(f"{t['ok']:>3}/{t['requests']:<4} p50 {_ms(t['p50_s']):>5} p99 {_ms(t['p99_s']):>5} ms")
            seen = ((result["with"].get("agent") or {}).get("workers") or {}).get(name) or {}
            why = f", {seen['max_level']}" + (f" ({', '.join(seen['reasons'])})" if seen.get("reasons") else "")
            throttled = f", throttled {seen['throttled_share']:.0%}" if seen else ""
            lines.append(f"turbo at worker {name}: without {cells[0]}  with {cells[1]}{why if seen else ''}{throttled}")
    agent = result["with"].get("agent") or {}
    if agent:
        levers = agent.get("levers") or {}
        lines.append("")
        lines.append(
            f"agent: highest level {agent['max_level']}"
            + (f" ({', '.join(agent['reasons'])})" if agent["reasons"] else "")
            + (f", worker throttled {agent['throttled_share']:.0%} of the time" if len(per_worker) <= 1 else "")
            + (f", levers engaged: {', '.join(f'{n} {v:.0%}' for n, v in sorted(levers.items()))}" if levers else "")
            + (f", last throttle {agent['last_throttle']}" if agent["last_throttle"] else "")
        )
    lines.append(
        "Latency: per image request, send to last byte, seen from the client namespace; turbo requests "
        "arrive open-loop (Poisson), the other tiers' clients are closed-loop. Refused: 429/503 answers "
        "(a shed or paused tier) and errors."
    )
    return "\n".join(lines)


def traffic(traffic: dict, rate_bps: int) -> str:
    """Each tier's share of the link under the mixed flows (sandbox.traffic), and the EF ping."""
    lines = [
        f"Mixed traffic through a {format_rate(rate_bps)} link, one TCP flow per tier at once "
        "(turbo paced to 20 %, the others as fast as they can):"
    ]
    for tier, bps in traffic["throughput_bps"].items():
        share = f"{bps / 1e6:6.1f} Mbit/s ({bps / rate_bps:4.0%} of the link)" if bps else "no result"
        lines.append(f"  {tier:<6} {share}")
    rtts = traffic["ef_ping_ms"]
    if rtts:
        p99 = rtts[min(len(rtts) - 1, int(0.99 * (len(rtts) - 1)))]
        lines.append(
            f"  EF ping under that load: p50 {rtts[len(rtts) // 2]:.3f} ms, p99 {p99:.3f} ms ({len(rtts)} replies)"
        )
    return "\n".join(lines)


def describe_agent(agent: dict) -> str:
    """One line of what the agent did during a load (sandbox/node.py AgentWatch.summary)."""
    text = f"{agent['max_level']}" + (f" ({', '.join(agent['reasons'])})" if agent["reasons"] else "")
    text += f", throttled {agent['throttled_share']:.0%}"
    levers = agent.get("levers") or {}
    if levers:
        text += ", levers " + ", ".join(f"{name} {share:.0%}" for name, share in sorted(levers.items()))
    for name, (p50, p90) in sorted((agent.get("signals_p50_p90") or {}).items()):
        text += f", {name} p50/p90 {p50:.2f}/{p90:.2f}"
    return text
