"""Degradation policy: signals in, a level and the actions for it out. Pure: no I/O, no clock.

Levels go normal -> pressured -> degraded -> critical (turbonode.levels). Each rule owns its
thresholds and dwell (`[policy.rules.<signal>]`). A rule becomes *active* once its signal has
stayed above its enter threshold for `enter_s` seconds, and inactive again once it has stayed
below its (lower) exit threshold for `exit_s` seconds; between the two it keeps its state
(hysteresis). While any rule is active the level climbs one step per `min_change_interval`, each
further step needing an active rule's `enter_s` of fresh evidence above enter, up to the highest
`max_level` of the active rules (a rule whose lever treats its cause stops at `pressured`);
once the level is above that and every rule not active has been below its exit threshold for
its `exit_s` since the last change, it steps down one level, and the next step down waits again.
A rule with max_level normal engages its levers only and has no say in the level either way
(the memory rules hold their levers for 30 s of calm; the level does not wait for them).

Dwell is time, not a count of samples, because samples are irregular: the agent samples on a
period and also at once when a source pushes (a PSI trigger, a worker GC pause). A sample
taken at `now` covers the time since the previous one, so a run above enter starts at the
previous sample's time: a signal above enter in every sample of the last `enter_s` seconds
has been above it for `enter_s`. An extra sample adds evidence of the same time, never time.

A signal value of None means "no observation this sample" (e.g. no GC ran): it neither
breaks nor lengthens a run above enter, and counts as healthy time, so a dead watcher never
pins a level.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turbonode.config.policy import PolicyConfig
from turbonode.config.rules import policy_rules
from turbonode.errors import ConfigError
from turbonode.levels import ACTION_LEVELS, LEVELS, NORMAL

_DEFAULTS = PolicyConfig()
_CLOCK_SLACK = 1e-9  # seconds: sums of float sample times land a hair short of an exact dwell
HELD = "held until below exit"  # an active rule whose signal sits between exit and enter (or is silent)


def _reached(elapsed: float, dwell: float) -> bool:
    return elapsed >= dwell - _CLOCK_SLACK


def describe_reason(signal: str, value: float | None, threshold: float, crossed: str) -> str:
    """'cpu_load=0.93 > 0.75', 'cpu_load=0.2 < 0.7' or 'cpu_load=0.72 (held until < 0.7)'."""
    shown = "n/a" if value is None else f"{value:.4g}"
    if crossed == HELD:
        return f"{signal}={shown} (held until < {threshold:.4g})"
    return f"{signal}={shown} {'>' if crossed == 'above enter' else '<'} {threshold:.4g}"


@dataclass(frozen=True)
class Rule:
    """One signal's thresholds and dwell (seconds), as oomd's detectors own theirs. A dwell of
    None takes the policy's (DegradationPolicy.enter_s / exit_s)."""

    signal: str
    enter: float
    exit: float
    enter_s: float | None = None
    exit_s: float | None = None
    levers: tuple[str, ...] = ()  # engaged while the rule is active (agent/levers/)
    max_level: int = len(LEVELS) - 1  # the highest level this rule raises the node to


@dataclass(frozen=True)
class Reason:
    signal: str
    value: float | None
    threshold: float
    crossed: str  # "above enter" | "below exit" | HELD

    def __str__(self) -> str:
        return describe_reason(self.signal, self.value, self.threshold, self.crossed)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Decision:
    at: float
    level: int
    previous: int
    reasons: tuple[Reason, ...]  # why the level is what it is (active rules, or recovery evidence)
    levers: tuple[tuple[str, Reason], ...] = ()  # each lever an active rule engages, with that rule's reason

    @property
    def changed(self) -> bool:
        return self.level != self.previous

    @property
    def level_name(self) -> str:
        return LEVELS[self.level]

    def change(self, at: float) -> dict[str, Any]:
        """This decision as a level change for the status, `at` its wall-clock time."""
        return {
            "at": at,
            "from": LEVELS[self.previous],
            "to": self.level_name,
            "reasons": [r.as_dict() for r in self.reasons],
        }

    def describe(self) -> str:
        why = ", ".join(map(str, self.reasons)) or "all signals healthy"
        if not self.changed:
            return f"{self.level_name} ({why})"
        verb = "escalate" if self.level > self.previous else "recover"
        return f"{verb} {LEVELS[self.previous]} -> {self.level_name}: {why}"


@dataclass
class _RuleState:
    enter_s: float  # the rule's dwell, its own or the policy's
    exit_s: float
    above_since: float | None = None  # start of the current run above enter (None: not in one)
    above_for: float = 0.0  # how long that run had lasted at its latest observation above enter
    below_since: float | None = None  # start of the current run below exit or silent
    active: bool = False
    value: float | None = None

    def below_for(self, now: float) -> float:
        return 0.0 if self.below_since is None else now - self.below_since


@dataclass
class DegradationPolicy:
    rules: tuple[Rule, ...]
    enter_s: float = _DEFAULTS.enter_s  # the dwell of rules that set none
    exit_s: float = _DEFAULTS.exit_s
    min_change_interval: float = _DEFAULTS.min_change_interval
    level: int = NORMAL
    last_change: float = -math.inf
    last_sample: float | None = None
    _state: dict[str, _RuleState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._state = {
            r.signal: _RuleState(
                self.enter_s if r.enter_s is None else r.enter_s, self.exit_s if r.exit_s is None else r.exit_s
            )
            for r in self.rules
        }
        # the rules as in force, each with its dwell
        self.rules = tuple(
            dataclasses.replace(r, enter_s=self._state[r.signal].enter_s, exit_s=self._state[r.signal].exit_s)
            for r in self.rules
        )

    def update(self, signals: Mapping[str, float | None], now: float) -> Decision:
        """Feed one sample taken at `now` (seconds, any monotonic clock), covering the time since
        the previous sample."""
        since = now if self.last_sample is None else self.last_sample
        self.last_sample = now
        for rule in self.rules:
            self._observe(rule, signals.get(rule.signal), since, now)
        previous = self.level
        active = [r for r in self.rules if self._state[r.signal].active]
        ceiling = max((r.max_level for r in active), default=NORMAL)  # the level the active rules ask for
        may_change = _reached(now - self.last_change, self.min_change_interval)
        if self.level < ceiling:
            fresh = any(
                _reached(self._state[r.signal].above_for, self._state[r.signal].enter_s)
                for r in active
                if r.max_level > self.level
            )
            if may_change and fresh:
                self._change(self.level + 1, now)
        elif self.level > ceiling:  # down once the rules not active (or capped below) have been healthy
            # a rule that never raises the level (max_level normal: its levers only) has no say in it
            healthy = all(
                _reached(self._state[r.signal].below_for(now), self._state[r.signal].exit_s)
                for r in self.rules
                if not self._state[r.signal].active and r.max_level > NORMAL
            )
            if may_change and healthy:
                self._change(self.level - 1, now)
        if active:
            reasons = tuple(self._active_reason(r) for r in active)
        else:
            reasons = (
                ()
                if self.level == previous
                else tuple(Reason(r.signal, self._state[r.signal].value, r.exit, "below exit") for r in self.rules)
            )
        return Decision(now, self.level, previous, reasons, self._levers())

    def _levers(self) -> tuple[tuple[str, Reason], ...]:
        """The levers of the active rules, each once, with the first such rule's reason (rule
        order): a lever follows its rules' hysteresis, not the level's steps."""
        out: dict[str, Reason] = {}
        for rule in self.rules:
            if self._state[rule.signal].active:
                for lever in rule.levers:
                    out.setdefault(lever, self._active_reason(rule))
        return tuple(out.items())

    def _active_reason(self, rule: Rule) -> Reason:
        value = self._state[rule.signal].value
        if value is not None and value > rule.enter:
            return Reason(rule.signal, value, rule.enter, "above enter")
        return Reason(rule.signal, value, rule.exit, HELD)  # active by hysteresis

    def _observe(self, rule: Rule, value: float | None, since: float, now: float) -> None:
        """One observation covering (since, now]."""
        st = self._state[rule.signal]
        st.value = value
        if value is None:
            if st.below_since is None:
                st.below_since = since
        elif value > rule.enter:
            if st.above_since is None:
                st.above_since = since
            st.above_for, st.below_since = now - st.above_since, None
        elif value < rule.exit:
            st.above_since, st.above_for = None, 0.0
            if st.below_since is None:
                st.below_since = since
        else:  # inside the hysteresis band: keep the state, restart both runs
            st.above_since, st.above_for, st.below_since = None, 0.0, None
        if _reached(st.below_for(now), st.exit_s):
            st.active, st.above_since, st.above_for = False, None, 0.0  # long silence also ends a run None held
        elif st.above_since is not None and _reached(st.above_for, st.enter_s):
            st.active = True

    def _change(self, level: int, now: float) -> None:
        self.level, self.last_change = level, now
        # Each further step needs fresh evidence: enter_s more above, or exit_s more below.
        for st in self._state.values():
            if st.above_since is not None:
                st.above_since, st.above_for = now, 0.0
            if st.below_since is not None:
                st.below_since = now

    def snapshot(self) -> dict[str, Any]:
        return {
            r.signal: {
                "value": self._state[r.signal].value,
                "enter": r.enter,
                "exit": r.exit,
                "active": self._state[r.signal].active,
            }
            for r in self.rules
        }


# ---- configuration ---------------------------------------------------------------------


def rules_from_config(cfg: PolicyConfig, scope: Callable[[str], bool] = lambda signal: True) -> tuple[Rule, ...]:
    """One rule per `[policy.rules.<signal>]` table (turbonode.config.rules.POLICY_RULES), less the disabled,
    for the signals `scope` takes (the node's or a worker's: agent/worker_unit.py)."""
    try:  # loading checked it; a PolicyConfig built in code is checked here
        policy_rules(cfg.rules)
    except ValueError as exc:
        raise ConfigError("policy.rules", str(exc)) from None
    return tuple(
        Rule(
            signal,
            t["enter"],
            t["exit"],
            t.get("enter_s"),
            t.get("exit_s"),
            tuple(t.get("levers", ())),
            LEVELS.index(t.get("max_level", LEVELS[-1])),
        )
        for signal, t in cfg.rules.items()
        if signal not in cfg.disabled and scope(signal)
    )


def policy_from_config(cfg: PolicyConfig, scope: Callable[[str], bool] = lambda signal: True) -> DegradationPolicy:
    return DegradationPolicy(rules_from_config(cfg, scope), cfg.enter_s, cfg.exit_s, cfg.min_change_interval)


# ---- actions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Actions:
    """What the agent enforces at one level. `throttle` is None or the worker's throttle params."""

    relax_ceil_pct: int | None = None
    throttle: dict[str, Any] | None = None


def actions_table(cfg: PolicyConfig) -> dict[int, Actions]:
    """Level index -> Actions; levels the file leaves out keep their defaults."""
    table = {**PolicyConfig().actions, **cfg.actions}
    out = {NORMAL: Actions()}
    for i, name in enumerate(ACTION_LEVELS, start=NORMAL + 1):
        acts = dict(table.get(name, {}))
        ceil = acts.pop("relax_ceil_pct", None)
        throttle = {k: v for k, v in acts.items() if v}
        out[i] = Actions(ceil, throttle or None)
    return out
