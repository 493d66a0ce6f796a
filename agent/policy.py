"""Degradation policy: signals in, a level and the actions for it out. Pure: no I/O, no clock.

Levels go normal -> pressured -> degraded -> critical (turbonode.levels). Each rule owns its
thresholds and dwell (`[policy.rules.<signal>]`). A rule becomes *active* when its signal is
above its enter threshold for its `enter_samples` consecutive samples, and inactive again after
its `exit_samples` consecutive samples below its (lower) exit threshold; between the two it
keeps its state (hysteresis). While any rule is active the level climbs one step per
`min_change_interval`, each further step needing an active rule's `enter_samples` fresh samples
above enter; once no rule is active and every signal has been below its exit threshold for its
`exit_samples` samples since the last change, it steps down one level, and the next step down
waits again.

A signal value of None means "no observation this sample" (e.g. no GC ran): it neither
breaks an escalation streak nor holds back recovery, so a dead watcher never pins a level.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from turbonode.config import PolicyConfig, policy_rules
from turbonode.errors import ConfigError
from turbonode.levels import ACTION_LEVELS, LEVELS, NORMAL

_DEFAULTS = PolicyConfig()
HELD = "held until below exit"  # an active rule whose signal sits between exit and enter (or is silent)


def describe_reason(signal: str, value: float | None, threshold: float, crossed: str) -> str:
    """'cpu_load=0.93 > 0.75', 'cpu_load=0.2 < 0.7' or 'cpu_load=0.72 (held until < 0.7)'."""
    shown = "n/a" if value is None else f"{value:.4g}"
    if crossed == HELD:
        return f"{signal}={shown} (held until < {threshold:.4g})"
    return f"{signal}={shown} {'>' if crossed == 'above enter' else '<'} {threshold:.4g}"


@dataclass(frozen=True)
class Rule:
    """One signal's thresholds and dwell, as oomd's detectors own theirs. A dwell of None takes
    the policy's (DegradationPolicy.enter_samples / exit_samples)."""

    signal: str
    enter: float
    exit: float
    enter_samples: int | None = None
    exit_samples: int | None = None
    levers: tuple[str, ...] = ()  # engaged while the rule is active (agent/levers/)


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

    def describe(self) -> str:
        why = ", ".join(map(str, self.reasons)) or "all signals healthy"
        if not self.changed:
            return f"{self.level_name} ({why})"
        verb = "escalate" if self.level > self.previous else "recover"
        return f"{verb} {LEVELS[self.previous]} -> {self.level_name}: {why}"


@dataclass
class _RuleState:
    enter_samples: int  # the rule's dwell, its own or the policy's
    exit_samples: int
    above: int = 0
    below: int = 0
    active: bool = False
    value: float | None = None


@dataclass
class DegradationPolicy:
    rules: tuple[Rule, ...]
    enter_samples: int = _DEFAULTS.enter_samples  # the dwell of rules that set none
    exit_samples: int = _DEFAULTS.exit_samples
    min_change_interval: float = _DEFAULTS.min_change_interval
    level: int = NORMAL
    last_change: float = -math.inf
    _state: dict[str, _RuleState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._state = {
            r.signal: _RuleState(r.enter_samples or self.enter_samples, r.exit_samples or self.exit_samples)
            for r in self.rules
        }
        # the rules as in force, each with its dwell
        self.rules = tuple(
            dataclasses.replace(
                r, enter_samples=self._state[r.signal].enter_samples, exit_samples=self._state[r.signal].exit_samples
            )
            for r in self.rules
        )

    def update(self, signals: Mapping[str, float | None], now: float) -> Decision:
        """Feed one sample taken at `now` (seconds, any monotonic clock)."""
        for rule in self.rules:
            self._observe(rule, signals.get(rule.signal))
        previous = self.level
        active = [r for r in self.rules if self._state[r.signal].active]
        may_change = now - self.last_change >= self.min_change_interval
        if active:
            fresh = any(self._state[r.signal].above >= self._state[r.signal].enter_samples for r in active)
            if may_change and fresh and self.level < len(LEVELS) - 1:
                self._change(self.level + 1, now)
            reasons = tuple(self._active_reason(r) for r in active)
        else:
            healthy = all(st.below >= st.exit_samples for st in self._state.values())
            if may_change and healthy and self.level > NORMAL:
                self._change(self.level - 1, now)
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

    def _observe(self, rule: Rule, value: float | None) -> None:
        st = self._state[rule.signal]
        st.value = value
        if value is None:
            st.below += 1
        elif value > rule.enter:
            st.above, st.below = st.above + 1, 0
        elif value < rule.exit:
            st.above, st.below = 0, st.below + 1
        else:  # inside the hysteresis band: keep the state, restart both streaks
            st.above = st.below = 0
        if st.below >= st.exit_samples:
            st.active, st.above = False, 0  # a long healthy run also ends a streak that None held
        elif st.above >= st.enter_samples:
            st.active = True

    def _change(self, level: int, now: float) -> None:
        self.level, self.last_change = level, now
        # Each further step needs fresh evidence: N more samples up, or M more samples down.
        for st in self._state.values():
            st.above = st.below = 0

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


def rules_from_config(cfg: PolicyConfig) -> tuple[Rule, ...]:
    """One rule per `[policy.rules.<signal>]` table (turbonode.config.POLICY_RULES), less the disabled."""
    try:  # loading checked it; a PolicyConfig built in code is checked here
        policy_rules(cfg.rules)
    except ValueError as exc:
        raise ConfigError("policy.rules", str(exc)) from None
    return tuple(
        Rule(signal, t["enter"], t["exit"], t.get("enter_samples"), t.get("exit_samples"), tuple(t.get("levers", ())))
        for signal, t in cfg.rules.items()
        if signal not in cfg.disabled
    )


def policy_from_config(cfg: PolicyConfig) -> DegradationPolicy:
    return DegradationPolicy(rules_from_config(cfg), cfg.enter_samples, cfg.exit_samples, cfg.min_change_interval)


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
