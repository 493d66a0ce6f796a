"""Several workers under one agent, decided with a fake clock (pure: no kernel, no sockets): the
node's rules act on every worker, a worker's own rules (GC pauses, turbo queue wait) on that
worker alone; the node's relax ceiling and its cpu_share lever follow the node's rules, each
worker's threads lever its own level. The loop as agent/daemon.py builds it, with watchers that
report what the test sets and throttle lanes without a socket (what they are told is checked)."""

from __future__ import annotations

from agent.actuator import Actuator
from agent.levers import Levers, WorkerLevers
from agent.loop import AgentLoop
from agent.policy import DegradationPolicy, actions_table, policy_from_config
from agent.throttle_lane import ThrottleLane
from agent.watchers.base import Watcher
from agent.watchers.worker import WorkerWatcher
from agent.worker_unit import WORKER_SIGNALS, WorkerUnit, node_scope, worker_scope
from turbonode.config import AgentConfig, LeversConfig, PolicyConfig, WorkerSpec
from turbonode.levels import LEVELS

PERIOD = AgentConfig().sample_period
POLICY = PolicyConfig(exit_s=1.0, min_change_interval=0.5)


class Told(Watcher):
    """Reports the signals the test sets (a stand-in for a source whose reading is tested elsewhere)."""

    def __init__(self, name: str, **signals: float | None):
        Watcher.__init__(self)  # not the next in a subclass's line (ToldWorker: WorkerWatcher's wants a feed)
        self.name, self.values = name, dict(signals)

    def read(self, now):
        return dict(self.values), {}


class ToldWorker(Told, WorkerWatcher):
    """A worker's feed that reports what the test sets: the unit's `feed`."""

    def __init__(self, **signals: float | None):
        Told.__init__(self, "worker", **signals)

    def due(self, now):
        return True

    def view(self):
        return {"state": "ok"}

    def summary(self):
        return Watcher.summary(self)


def unit(name: str) -> WorkerUnit:
    spec = WorkerSpec(name, f"/nonexistent/{name}.sock", "", (), "cpu", "", frozenset())
    return WorkerUnit(
        spec,
        ToldWorker(gc_pause_s=None, turbo_wait_s=0.0),
        None,
        policy_from_config(POLICY, worker_scope),
        ThrottleLane(name, None, 3.0),  # no socket: what it is told to send is what the test reads
        WorkerLevers(LeversConfig(), name),
    )


def node_loop(names=("a", "b")) -> tuple[AgentLoop, Told]:
    cpu = Told("cpu", cpu_load=0.05)
    loop = AgentLoop(
        [cpu],
        policy_from_config(POLICY, node_scope),
        actions_table(POLICY),
        Actuator(dry_run=True),
        [unit(n) for n in names],
        PERIOD,
    )
    return loop, cpu


def run(loop: AgentLoop, start: float, seconds: float) -> float:
    t = start
    while t < start + seconds:
        loop.step(t)
        t += PERIOD
    return t


def levels(loop: AgentLoop) -> dict[str, str]:
    return {"node": LEVELS[loop.policy.level], **{u.name: LEVELS[u.level] for u in loop.workers}}


def wanted(loop: AgentLoop) -> dict[str, dict | None]:
    return {u.name: u.lane._want for u in loop.workers}


def test_the_rules_split_into_the_nodes_and_each_workers():
    node = {r.signal for r in policy_from_config(PolicyConfig(), node_scope).rules}
    own = {r.signal for r in policy_from_config(PolicyConfig(), worker_scope).rules}
    assert own == {"gc_pause_s", "turbo_wait_s"} and own <= WORKER_SIGNALS
    assert {"cpu_load", "netrx_latency_p99_s", "netrx_cpu_share"} <= node and not node & own
    assert node | own == {r.signal for r in policy_from_config(PolicyConfig()).rules}


def test_a_gc_storm_in_one_worker_throttles_it_alone():
    loop, _ = node_loop()
    a = loop.workers[0]
    t = run(loop, 0.0, 1.0)
    assert levels(loop) == {"node": "normal", "a": "normal", "b": "normal"}
    a.feed.values["gc_pause_s"] = 0.02  # long pauses one after another in worker a only
    t = run(loop, t, 1.0)
    assert levels(loop) == {"node": "normal", "a": "degraded", "b": "normal"}  # the rule's max_level
    assert wanted(loop) == {"a": {"max_batch": 2, "paused_tiers": ["relax"], "step_caps": {"fast": 8}}, "b": None}
    assert "gc_pause_s=0.02 > 0.005" in a.lane._reason
    assert loop.actuator.applied.relax_ceil_pct is None  # the node's relax ceiling is not a's to lower
    st = loop.status()
    assert st["level"] == "degraded" and st["node"]["level"] == "normal"
    assert [(r["signal"], r.get("worker")) for r in st["active"]] == [("gc_pause_s", "a")]
    assert st["workers"]["a"]["last_change"]["reasons"][0]["signal"] == "gc_pause_s"
    assert st["workers"]["b"]["last_change"] is None
    a.feed.values["gc_pause_s"] = None  # the storm ends: a recovers after its dwell, b never moved
    t = run(loop, t, 3.0)
    assert levels(loop) == {"node": "normal", "a": "normal", "b": "normal"}
    assert wanted(loop) == {"a": None, "b": None}
    levels_b = loop.metrics_state()[0]
    assert levels_b == {"a": 0, "b": 0}


def test_a_full_turbo_queue_in_one_worker_takes_it_to_critical_alone():
    loop, _ = node_loop(("a", "b", "c"))
    b = loop.workers[1]
    b.feed.values["turbo_wait_s"] = 1.5
    run(loop, 0.0, 4.0)
    assert levels(loop) == {"node": "normal", "a": "normal", "b": "critical", "c": "normal"}
    assert wanted(loop)["b"]["unready_tiers"] == ["turbo"] and wanted(loop)["a"] is None is wanted(loop)["c"]


def test_a_cpu_hog_acts_on_every_worker_and_on_the_node():
    loop, cpu = node_loop()
    cpu.values["cpu_load"] = 0.9
    t = run(loop, 0.0, 1.0)
    assert levels(loop) == {"node": "pressured", "a": "pressured", "b": "pressured"}
    # the cpu_load rule's levers: worker_threads on each worker's throttle, cpu_share for the node
    assert wanted(loop) == {"a": {"max_batch": 2, "intra_op_threads": 1}, "b": {"max_batch": 2, "intra_op_threads": 1}}
    assert loop.actuator.applied.relax_ceil_pct == 50 and loop.actuator.levers is None
    _, counts, levers = loop.metrics_state()
    assert {k for k, on in levers.items() if on} == {("worker_threads", "a"), ("worker_threads", "b")}
    assert counts[("worker_threads_engage", "cpu_load", "a")] == 1
    # a GC storm in a on top: a goes further only if its own rule asks for more than the node's
    loop.workers[0].feed.values["turbo_wait_s"] = 1.5
    t = run(loop, t, 3.0)
    assert levels(loop)["a"] == "critical" and levels(loop)["b"] == "pressured"
    cpu.values["cpu_load"] = 0.05
    loop.workers[0].feed.values["turbo_wait_s"] = 0.0
    run(loop, t, 8.0)
    assert levels(loop) == {"node": "normal", "a": "normal", "b": "normal"}
    assert wanted(loop) == {"a": None, "b": None}
    assert not any(loop.metrics_state()[2].values())


def test_node_memory_pressure_locks_every_worker_and_engages_the_nodes_memory_levers(tmp_path):
    """memory_protect is a worker's lever (its lock, a field of its throttle) and the node's (every
    worker's memory.min): a node rule that wants it reaches both."""
    loop, _ = node_loop()
    memory = Told("memory", psi_memory_some=0.0)
    loop.watchers.append(memory)
    loop.actuator.levers = Levers(LeversConfig(), str(tmp_path / "levers.json"), [], dry_run=True)
    t = run(loop, 0.0, 1.0)
    memory.values["psi_memory_some"] = 0.3
    run(loop, t, 1.0)
    st = loop.actuator.levers.status()
    assert st["memory_squeeze"]["engaged"] and st["memory_protect"]["engaged"], st
    assert all(want and want.get("lock_memory") for want in wanted(loop).values()), wanted(loop)


def test_an_empty_rule_set_is_a_policy_that_stays_normal():
    policy = DegradationPolicy(())
    assert policy.update({"cpu_load": 1.0}, 0.0).level == 0
