"""One worker of the node as the agent drives it (docs/agent.md, "Several workers").

The node-wide watchers (CPU, PSI, softnet, softirq, HTB) are sampled once, by the loop; each
worker has its own: its feed (status and events: GC pauses, turbo queue wait, step time) and its
GPU through NVML. The rules on a worker's signals (WORKER_SIGNALS) make up its own policy, the
others the node's: a worker's level is the higher of the two, so a GC storm or a full turbo queue
in worker A raises A alone, while a CPU hog or a softirq storm raises every worker. Its throttle
(its level's, with the levers that act on it alone) goes through its own lane
(agent/throttle_lane.py): a worker that is dead, still loading or wedged is its own failed
watcher and its own failed throttle, and never delays another's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from turbonode.config import Config, WorkerSpec
from turbonode.jsonrpc import ControlClient
from turbonode.levels import LEVELS, NORMAL

from .levers import WORKER_LEVERS, WorkerLevers
from .policy import Actions, Decision, DegradationPolicy, Reason, policy_from_config, rules_from_config
from .throttle_lane import ThrottleLane
from .watchers.base import Watcher
from .watchers.gpu import GpuWatcher
from .watchers.worker import WorkerWatcher
from .watchers.worker_feed import WorkerFeed

log = logging.getLogger("turbonode.agent")

# The signals about one worker: the rules on them are that worker's, the others the node's.
WORKER_SIGNALS = frozenset(WorkerWatcher.signal_names + GpuWatcher.signal_names)
LANE_TIMEOUT_S = 0.5  # a throttle call's answer, at least (two sample periods when they are longer)


def node_scope(signal: str) -> bool:
    return signal not in WORKER_SIGNALS


def worker_scope(signal: str) -> bool:
    return signal in WORKER_SIGNALS


def combine(node: Decision, own: Decision, previous: int) -> Decision:
    """A worker's decision: the higher level of the node's and its own, that one's reasons first;
    its levers are its own rules' (the node's act through the loop)."""
    first, second = (own, node) if own.level >= node.level else (node, own)
    return Decision(own.at, first.level, previous, first.reasons + second.reasons, own.levers)


def cause_of(last: Decision | None) -> tuple[str, str]:
    """(signal, reason) of the latest level change: the metrics' label ('recovery' after a step
    down) and what the worker is told."""
    if last is None:
        return "recovery", "normal"
    up = last.level > last.previous
    return (last.reasons[0].signal if up and last.reasons else "recovery"), last.describe()


@dataclass
class WorkerUnit:
    spec: WorkerSpec
    feed: WorkerWatcher
    gpu: GpuWatcher | None
    policy: DegradationPolicy  # the rules on this worker's signals
    lane: ThrottleLane
    levers: WorkerLevers
    level: int = NORMAL
    decision: Decision | None = None
    last_change: Decision | None = None
    last_change_wall: float | None = None
    applied: Actions = field(default_factory=Actions)
    lever_counts: Counter = field(default_factory=Counter)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def watchers(self) -> list[Watcher]:
        return [self.feed] if self.gpu is None else [self.feed, self.gpu]

    def step(
        self, node: Decision, node_levers: tuple[tuple[str, Reason], ...], actions: dict[int, Actions], now: float
    ) -> Decision:
        """Sample its watchers, decide its level, and tell its lane what the worker should have.
        `node_levers` are the node-wide rules' levers: those that act on a worker act on this one."""
        fresh: dict = {}
        for w in self.watchers:
            fresh.update(w.sample(now))
        decision = combine(node, self.policy.update(fresh, now), self.level)
        self.level, self.decision = decision.level, decision
        if decision.changed:
            self.last_change, self.last_change_wall = decision, time.time()
            up = decision.level > decision.previous
            log.log(logging.WARNING if up else logging.INFO, "worker %s: level %s", self.name, decision.describe())
        cause, reason = cause_of(self.last_change)
        wanted: dict[str, Reason] = {}
        for lever, why in (*decision.levers, *node_levers):
            if lever in WORKER_LEVERS:
                wanted.setdefault(lever, why)
        self.lever_counts.update(
            self.levers.reconcile(
                {k: str(r) for k, r in wanted.items()}, {k: r.signal for k, r in wanted.items()}, cause
            )
        )
        self.applied = actions[decision.level]
        throttle = self.applied.throttle
        extra = self.levers.throttle_fields()
        if extra:
            if throttle is None:  # the lever alone: the worker hears its rule's reason
                reason = self.levers.throttle_reason()
            throttle = {**(throttle or {}), **extra}
        self.lane.want(throttle, reason, cause)
        return decision

    def release(self, reason: str) -> None:
        """At the agent's stop: its levers off, its throttle released (by the lane)."""
        self.lever_counts.update(self.levers.reconcile({}, {}, "shutdown"))
        self.lane.want(None, reason, "shutdown")

    def counts(self) -> Counter:
        """(action, signal) -> n: its throttles and its levers."""
        return self.lane.counted() + self.lever_counts

    def status(self) -> dict[str, Any]:
        d = self.decision
        lane = self.lane.state()
        return {
            "socket": self.spec.control_socket,
            **self.feed.view(),  # the worker as it last answered: state, queues, its throttle in force
            "level": LEVELS[self.level],
            "level_index": self.level,
            "active": [] if d is None else [r.as_dict() for r in d.reasons if r.crossed != "below exit"],
            "last_change": None if self.last_change is None else self.last_change.change(self.last_change_wall or 0),
            "signals": {k: v for w in self.watchers for k, v in w.signals.items()},
            "rules": self.policy.snapshot(),
            "watchers": {w.name: w.summary() for w in self.watchers},
            "applied": self.applied.throttle,
            "sent": lane["sent"],  # as sent: the level's throttle and the levers' fields
            "throttle_error": lane["error"],
            "hold": lane["hold"],
            "levers": self.levers.status(),
        }


def worker_unit(spec: WorkerSpec, cfg: Config, gpu_nvml=None) -> WorkerUnit:
    """A worker's watchers, policy, lane and levers from the configuration."""
    a = cfg.agent
    # the worker pushes what crosses a rule's enter threshold
    feed = WorkerWatcher(
        WorkerFeed(spec.control_socket, {r.signal: r.enter for r in rules_from_config(cfg.policy)}, name=spec.name)
    )
    # its GPU: the one it names (on CUDA), else the configured index, else (an unnamed worker) all
    on_gpu = spec.gpus != () or spec.device.startswith("cuda")
    gpu = GpuWatcher(gpu_nvml, spec.gpus, feed.gpu_uuid) if on_gpu else None
    for w in (feed, gpu):
        if w is not None:
            w.owner = f"worker {spec.name}: "
    client = ControlClient(spec.control_socket, timeout=max(LANE_TIMEOUT_S, 2 * a.sample_period))
    return WorkerUnit(
        spec,
        feed,
        gpu,
        policy_from_config(cfg.policy, worker_scope),
        ThrottleLane(spec.name, client, a.throttle_ttl, a.dry_run, retry_s=a.sample_period),
        WorkerLevers(cfg.levers, spec.name, a.dry_run),
    )
