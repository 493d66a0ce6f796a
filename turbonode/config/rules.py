"""The agent's policy rules ([policy.rules.<signal>]): each signal's default thresholds, levers
and highest level, with the reasons for them, and the check of the file's rule tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..levels import ACTION_LEVELS, LEVELS
from .checks import Check, fraction, in_range, positive
from .levers import LEVER_NAMES

MAX_DWELL_S = 3600.0  # a rule's enter_s / exit_s: beyond an hour it never acts
MEMORY_EXIT_S = 30.0  # the memory rules' dwell below exit before their levers are released


@dataclass(frozen=True)
class RuleDefaults:
    """A policy rule's default thresholds, the check its values pass, what its signal is, the
    levers it engages while active, and the highest level it may raise the node to."""

    enter: float
    exit: float
    check: Check
    help: str
    levers: tuple[str, ...] = ()
    max_level: str = ACTION_LEVELS[-1]
    exit_s: float | None = None  # its own dwell below exit (None: policy.exit_s)


# The policy's rules, one per signal a watcher publishes (docs/agent.md): above `enter` for
# enter_s seconds a rule is active, below `exit` for exit_s seconds it is healthy again
# (hysteresis; each rule's dwell defaults to policy.enter_s / policy.exit_s).
# A rule whose cause is treated raises the level only to `pressured`: the lever rules (the
# worker's CPU share and threads) and GC pauses, which the worker's traced graphs ride out
# (worker.torch_graphs). Throttling lower tiers further is left to the effect on turbo
# (turbo_wait_s), so that lower tiers keep making progress while turbo is protected
# (docs/benchmarks.md, node SLO).
# Adding a rule is one entry here: the config, its example and the agent's policy follow.
POLICY_RULES: dict[str, RuleDefaults] = {
    # contention, not the worker's own compute (agent/watchers/cpu.py): the node SLO's idle cell
    # read p50/p90 0.01/0.05, a hog on every CPU 0.54/0.82 with the levers engaged
    # (docs/benchmarks.md, "cpu_load as contention")
    "cpu_load": RuleDefaults(
        0.35,
        0.25,
        fraction,
        "CPU busy fraction taken by others than the worker (incl. softirq, steal)",
        ("cpu_share", "worker_threads"),
        "pressured",
    ),
    "gc_pause_s": RuleDefaults(0.005, 0.001, positive, "longest new worker GC pause (s)", (), "degraded"),
    "netrx_latency_p99_s": RuleDefaults(
        200e-6, 50e-6, positive, "NET_RX softirq raise-to-run p99 (s)", ("cpu_share",), "pressured"
    ),
    "netrx_cpu_share": RuleDefaults(
        0.25, 0.10, fraction, "busiest CPU's share of time in the NET_RX softirq", ("cpu_share",), "pressured"
    ),
    "turbo_wait_s": RuleDefaults(0.5, 0.25, positive, "oldest queued turbo job's wait (s)"),
    # memory and io (agent/watchers/psi.py, memory.py; docs/benchmarks.md, node SLO memory cells).
    # Their levers treat the cause (the worker's pages kept, the job held), the level's throttle does
    # not (a smaller batch takes no page from the job): levers only. Released 3 s after the stall, the
    # lock let the job's next push evict the worker again (seen in the node SLO memory cells'
    # logs, docs/benchmarks.md): they hold for 30 s of calm (memory cell 13.12x -> 0.87x the idle p99), and
    # best_effort_memory_held keeps them while the held job pushes.
    "psi_memory_some": RuleDefaults(
        0.10,
        0.02,
        fraction,
        "the node's memory stall fraction (PSI some)",
        ("memory_squeeze", "memory_protect"),
        "normal",
        MEMORY_EXIT_S,
    ),
    # the worker's own cgroup's stall (v2 only; None elsewhere: healthy): the node's thresholds, the
    # worker's stall being the part of the node's that matters (not measured: no v2 memory here)
    "worker_psi_memory_some": RuleDefaults(
        0.10,
        0.02,
        fraction,
        "the worker's memory cgroup's stall fraction (PSI some; cgroup v2)",
        ("memory_squeeze", "memory_protect"),
        "normal",
        MEMORY_EXIT_S,
    ),
    "worker_major_faults_per_s": RuleDefaults(
        50.0,
        5.0,
        positive,
        "the worker's major page faults per second (its code and files read back)",
        ("memory_squeeze", "memory_protect"),
        "normal",
        MEMORY_EXIT_S,
    ),
    # the squeeze holds while the job pushes against it, after the stall it caused has gone; it only
    # keeps the levers engaged (max_level normal: nothing to throttle in the worker for it)
    "best_effort_memory_held": RuleDefaults(
        0.5,
        0.5,
        fraction,
        "1 while a best-effort cgroup pushes against the limit memory_squeeze set, else 0",
        ("memory_squeeze", "memory_protect"),
        "normal",
    ),
    # io: the worker reads and writes nothing while it serves; a stalled writer's own waits are the
    # node's io stall (PSI some), so throttling the worker's lower tiers for it helps nobody: the
    # rule weighs and caps the best-effort cgroups' io (max_level normal)
    "psi_io_some": RuleDefaults(
        0.30, 0.10, fraction, "the node's io stall fraction (PSI some)", ("io_weight", "io_throttle"), "normal"
    ),
}
POLICY_SIGNALS = tuple(POLICY_RULES)
RULE_KEYS = ("enter", "exit", "enter_s", "exit_s", "levers", "max_level")
check_dwell = in_range(0, MAX_DWELL_S, " s")  # enter_s / exit_s, the policy's and each rule's


def policy_signals(v: Any) -> None:
    for name in v:
        if name not in POLICY_SIGNALS:
            raise ValueError(f"unknown signal {name!r} (known: {', '.join(POLICY_SIGNALS)})")


def merged_rules(rules: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rule's table: the file's keys over the defaults, key by key (naming only `enter`
    keeps the default `exit`)."""
    return {
        signal: {
            "enter": d.enter,
            "exit": d.exit,
            "levers": list(d.levers),
            "max_level": d.max_level,
            **({"exit_s": d.exit_s} if d.exit_s is not None else {}),
            **rules.get(signal, {}),
        }
        for signal, d in POLICY_RULES.items()
    }


def policy_rules(v: Any) -> None:
    """[policy.rules.<signal>]: enter and exit thresholds (exit <= enter), optional own dwell
    (seconds), levers, highest level."""
    for signal, table in v.items():
        if signal not in POLICY_RULES:
            raise ValueError(f"unknown signal {signal!r} (known: {', '.join(POLICY_SIGNALS)})")
        if not isinstance(table, dict):
            raise ValueError(f"{signal}: expected a table, got {table!r}")
        for k, x in table.items():
            where = f"{signal}.{k}"
            if k not in RULE_KEYS:
                raise ValueError(f"{where}: unknown key (known: {', '.join(RULE_KEYS)})")
            if k == "levers":
                if not isinstance(x, list) or any(lever not in LEVER_NAMES for lever in x):
                    raise ValueError(f"{where}: expected a list of levers from {', '.join(LEVER_NAMES)}, got {x!r}")
                continue
            if k == "max_level":  # normal: a rule that only engages its levers
                if x not in LEVELS:
                    raise ValueError(f"{where}: expected one of {', '.join(LEVELS)}, got {x!r}")
                continue
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"{where}: expected a number, got {x!r}")
            try:
                (POLICY_RULES[signal].check if k in ("enter", "exit") else check_dwell)(x)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
    for signal, table in merged_rules(v).items():
        if table["exit"] > table["enter"]:
            raise ValueError(f"{signal}.exit: must not exceed {signal}.enter ({table['enter']}), got {table['exit']}")
