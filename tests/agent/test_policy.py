"""The policy with a fake clock and recorded signal sequences (pure: no kernel, no sockets).

Dwell is time: the tests feed samples at the agent's default period, and also at irregular
times (extra samples the agent takes when a source pushes), which must not shorten it."""

import random

import pytest

from agent.policy import Actions, DegradationPolicy, Rule, actions_table, policy_from_config, rules_from_config
from turbonode.config import POLICY_RULES, AgentConfig, PolicyConfig, load_config
from turbonode.errors import ConfigError

PERIOD = AgentConfig().sample_period
CPU = Rule("cpu_load", 0.75, 0.70)
GC = Rule("gc_pause_s", 0.005, 0.001)


def run(policy, values, signal="cpu_load", start=0.0, period=PERIOD):
    """Feed one value per sample period; return the decisions."""
    return [policy.update({signal: v}, start + i * period) for i, v in enumerate(values)]


def levels(decisions):
    return [d.level for d in decisions]


def changes(decisions):
    return [(round(d.at, 6), d.previous, d.level) for d in decisions if d.changed]


def noisy(mean, sd, n, seed=4):
    rng = random.Random(seed)
    return [min(1.0, max(0.0, mean + rng.gauss(0, sd))) for _ in range(n)]


FIVE_MINUTES = round(5 * 60 / PERIOD)


def test_healthy_noise_with_spikes_over_threshold_changes_nothing():
    values = noisy(0.60, 0.08, FIVE_MINUTES)
    assert sum(v > 0.75 for v in values) > 50  # single spikes do cross the enter threshold, often
    assert sum(a > 0.75 and b > 0.75 for a, b in zip(values, values[1:])) >= 2  # and twice in a row
    assert changes(run(DegradationPolicy((CPU,)), values)) == []


def test_healthy_noise_sampled_irregularly_changes_nothing():
    # Pushed sources add samples at any moment: more samples of the same noise add no time above.
    rng = random.Random(7)
    times = sorted(rng.uniform(0, 300) for _ in range(2 * FIVE_MINUTES))
    values = noisy(0.60, 0.06, len(times), seed=8)
    p = DegradationPolicy((CPU,))
    assert [d for d in (p.update({"cpu_load": v}, t) for t, v in zip(times, values)) if d.changed] == []


@pytest.mark.parametrize("mean", [0.70, 0.725, 0.75, 0.78])
def test_noise_around_threshold_never_flaps(mean):
    d = run(DegradationPolicy((CPU,)), noisy(mean, 0.03, FIVE_MINUTES))
    steps = [c[2] - c[1] for c in changes(d)]
    # It may escalate, but never goes back and forth: no reversal of direction.
    reversals = sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))
    assert reversals == 0, changes(d)


@pytest.mark.parametrize("period", [PERIOD, 0.05, 0.25])
def test_step_change_escalates_after_enter_s_whatever_the_period(period):
    p = DegradationPolicy((CPU,), enter_s=0.3)
    onset = 2.0
    d = run(p, [0.2] * round(onset / period) + [0.95] * round(1 / period), period=period)
    first = next(x for x in d if x.changed)
    # The sample after the onset covers time since the one before: 0.3 s above from there on.
    assert first.level == 1 and onset + 0.3 - period - 1e-9 <= first.at <= onset + 0.3 + 1e-9
    assert first.reasons[0].signal == "cpu_load"
    assert first.reasons[0].value == 0.95 and first.reasons[0].threshold == 0.75
    assert "cpu_load=0.95 > 0.75" in first.describe()


def test_extra_samples_do_not_shorten_the_dwell():
    p = DegradationPolicy((CPU,), enter_s=0.3)
    run(p, [0.2] * 10)  # healthy until t = 0.9
    d = [p.update({"cpu_load": 0.95}, 1.0 + i * 0.01) for i in range(20)]  # 20 pushed samples in 0.2 s
    assert not any(x.changed for x in d)
    assert p.update({"cpu_load": 0.95}, 1.2).changed  # 0.3 s after the last healthy sample


def test_one_change_per_interval_and_fresh_evidence_per_step():
    p = DegradationPolicy((CPU,), enter_s=0.3, min_change_interval=1.0)
    d = run(p, [0.99] * round(10 / PERIOD))  # 10 s of saturation
    ch = changes(d)
    assert [c[2] for c in ch] == [1, 2, 3]  # one step at a time, stops at critical
    times = [c[0] for c in ch]
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(times, times[1:]))


def test_recovery_waits_its_dwell_step_by_step():
    p = DegradationPolicy((CPU,), enter_s=0.3, exit_s=2.0, min_change_interval=1.0)
    end = 3.0
    d = run(p, [0.99] * round(end / PERIOD) + [0.1] * round(15 / PERIOD))
    ch = changes(d)
    ups = [c for c in ch if c[2] > c[1]]
    downs = [c for c in ch if c[2] < c[1]]
    top = ups[-1][2]
    assert [c[2] for c in downs] == list(range(top - 1, -1, -1))
    # The first step down needs exit_s below exit after the load ended.
    assert downs[0][0] >= end + 2.0 - PERIOD
    # Each further step waits another full dwell.
    assert all(b[0] - a[0] >= 2.0 - 1e-9 for a, b in zip(downs, downs[1:]))
    first_down = next(x for x in d if x.changed and x.level < x.previous)
    assert "below exit" in first_down.reasons[0].crossed


def test_hysteresis_band_holds_the_level():
    p = DegradationPolicy((CPU,), enter_s=0.2, exit_s=0.4)
    d = run(p, [0.9] * 3 + [0.72] * 40)  # between exit (0.70) and enter (0.75)
    assert levels(d)[-1] == 1 and len(changes(d)) == 1
    assert "cpu_load=0.72 (held until < 0.7)" in d[-1].describe()
    d = run(p, [0.5] * 6, start=20)
    assert levels(d)[-1] == 0


def test_none_keeps_a_run_and_counts_as_healthy():
    p = DegradationPolicy((GC,), enter_s=0.3, exit_s=1.0)
    # Long pauses with samples between where no collection ran: the run above goes on.
    d = run(p, [0.02, None, 0.03, None, None, 0.02], signal="gc_pause_s")
    assert levels(d)[-1] == 1
    # Silence alone adds no evidence: one pause then nothing never escalates.
    q = DegradationPolicy((GC,), enter_s=0.3, exit_s=1.0)
    assert levels(run(q, [0.05] + [None] * 30, signal="gc_pause_s")) == [0] * 31
    d = run(p, [0.0005, 0.003], signal="gc_pause_s", start=10)  # a 3 ms pause breaks the healthy run
    d += run(p, [None] * 12, signal="gc_pause_s", start=11)
    assert levels(d)[-1] == 0


def test_gc_storm_pushed_pause_by_pause_escalates():
    # The worker pushes each long pause as it happens (about every 100 ms in bench/garbage.py's
    # storm), between the agent's ticks; a tick with no new pause observes nothing (None).
    p = DegradationPolicy((GC,), enter_s=0.3)
    samples = sorted([(t / 10, None) for t in range(20)] + [(1.03 + 0.1 * k, 0.06) for k in range(6)])
    d = [p.update({"gc_pause_s": v}, t) for t, v in samples]
    first = next(x for x in d if x.changed)
    assert first.level == 1 and 1.2 < first.at < 1.35  # the run began at the tick before the first pause


def test_periodic_report_without_a_long_pause_breaks_the_run():
    # The worker also answers every period when nothing happened: its short pauses are healthy.
    p = DegradationPolicy((GC,), enter_s=0.3)
    d = run(p, [0.02, 0.0002, 0.02, 0.0002, 0.02, 0.0002, 0.02], signal="gc_pause_s")
    assert levels(d) == [0] * 7


def test_silence_after_a_run_at_the_top_level_recovers():
    # At critical no escalation restarts the run; the silence after it (None: no GC ran)
    # must still end it, or the level would stay up for good.
    p = DegradationPolicy((GC,), enter_s=0.3, exit_s=1.0, min_change_interval=0)
    d = run(p, [0.05] * 12, signal="gc_pause_s")
    assert d[-1].level == 3
    d = run(p, [None] * 60, signal="gc_pause_s", start=10)
    assert [c[2] for c in changes(d)] == [2, 1, 0]


def test_any_active_signal_holds_level():
    wait = Rule("turbo_wait_s", 0.5, 0.25)
    p = DegradationPolicy((CPU, wait), enter_s=0.2, exit_s=0.5, min_change_interval=0)
    for t in range(3):
        d = p.update({"cpu_load": 0.9, "turbo_wait_s": 0.0}, t * PERIOD)
    assert d.level == 1
    for t in range(3, 30):
        d = p.update({"cpu_load": 0.1, "turbo_wait_s": 0.8 if t < 6 else 0.4}, t * PERIOD)
    assert d.level >= 1  # turbo wait stuck in its band keeps the level


def test_config_defaults_and_actions():
    cfg = PolicyConfig()
    p = policy_from_config(cfg)
    assert (
        {r.signal for r in p.rules}
        == set(POLICY_RULES)
        == {"cpu_load", "gc_pause_s", "netrx_latency_p99_s", "netrx_cpu_share", "turbo_wait_s"}
        | {"psi_memory_some", "worker_psi_memory_some", "worker_major_faults_per_s", "best_effort_memory_held"}
        | {"psi_io_some"}
    )
    cpu = next(r for r in p.rules if r.signal == "cpu_load")
    assert (cpu.enter, cpu.exit, cpu.enter_s, cpu.exit_s) == (0.35, 0.25, 0.3, 3.0)
    table = actions_table(cfg)
    assert table[0] == Actions()
    assert table[1].relax_ceil_pct == 50 and table[1].throttle == {"max_batch": 2}
    assert table[3].throttle["shed_tiers"] == ["relax"]
    for acts in table.values():
        for key in ("paused_tiers", "shed_tiers", "step_caps"):
            assert "turbo" not in (acts.throttle or {}).get(key, [])


def test_config_overrides_one_level_and_names_bad_keys(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text("[policy.rules.cpu_load]\nenter = 0.9\n[policy.actions.pressured]\nmax_batch = 3\n")
    cfg = load_config(str(f), env={})
    table = actions_table(cfg.policy)
    assert table[1] == Actions(None, {"max_batch": 3})
    assert table[2].relax_ceil_pct == 25  # untouched levels keep their defaults
    for text, key in [
        ("[policy.rules.cpu_load]\nenter = 1.5\n", "policy.rules"),
        ("[policy]\nbogus = 1\n", "policy.bogus"),
        ('[policy.actions.critical]\nshed_tiers = ["turbo"]\n', "policy.actions"),
        ("[policy.actions.panic]\nmax_batch = 1\n", "policy.actions"),
    ]:
        f.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_config(str(f), env={})
        assert exc.value.key == key
    f.write_text('[policy.actions.critical]\nshed_tiers = ["turbo"]\n')
    with pytest.raises(ConfigError, match="turbo tier cannot be throttled"):
        load_config(str(f), env={})
    f.write_text('[policy]\ndisabled = ["cpu_load", "psi"]\n')
    with pytest.raises(ConfigError, match="unknown signal 'psi'") as exc:
        load_config(str(f), env={})
    assert exc.value.key == "policy.disabled"
    f.write_text('[policy]\ndisabled = ["cpu_load"]\n')
    assert "cpu_load" not in {r.signal for r in rules_from_config(load_config(str(f), env={}).policy)}
    with pytest.raises(ConfigError, match="cpu_load.exit: must not exceed cpu_load.enter") as exc:
        rules_from_config(PolicyConfig(rules={"cpu_load": {"enter": 0.5, "exit": 0.6}}))
    assert exc.value.key == "policy.rules"


def test_each_rule_owns_its_thresholds_and_dwell(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(
        "[policy]\nenter_s = 0.5\n[policy.rules.gc_pause_s]\nenter_s = 0\n[policy.rules.cpu_load]\nenter = 0.9\n"
    )
    cfg = load_config(str(f), env={}).policy
    p = policy_from_config(cfg)
    rules = {r.signal: r for r in p.rules}
    # a partial table keeps the other defaults; a rule without its own dwell takes the policy's
    assert (rules["cpu_load"].enter, rules["cpu_load"].exit, rules["cpu_load"].enter_s) == (0.9, 0.25, 0.5)
    assert rules["gc_pause_s"].enter_s == 0 and rules["gc_pause_s"].exit_s == 3.0
    assert p.update({"gc_pause_s": 0.02, "cpu_load": 0.1}, 0).level == 1  # one long pause suffices
    cpu = policy_from_config(cfg)
    d = run(cpu, [0.95] * 8, period=0.1)
    assert levels(d) == [0] * 5 + [1] * 3  # cpu_load needs half a second
    for text, match in [
        ("[policy.rules.cpu_load]\nenter_s = -1\n", "cpu_load.enter_s: must be between 0 and 3600 s"),
        ('[policy.rules.cpu_load]\nexit_s = "3s"\n', "cpu_load.exit_s: expected a number"),
        ("[policy.rules.cpu_load]\nenter_samples = 3\n", "cpu_load.enter_samples: unknown key"),
        ("[policy.rules.psi]\nenter = 1\n", "unknown signal 'psi'"),
        ("[policy.rules.cpu_load]\nbogus = 1\n", "cpu_load.bogus: unknown key"),
        ("[policy.rules.cpu_load]\nexit = 0.8\n", r"cpu_load.exit: must not exceed cpu_load.enter \(0.35\)"),
        ('[policy.rules.gc_pause_s]\nenter = "5ms"\n', "gc_pause_s.enter: expected a number"),
    ]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=match) as exc:
            load_config(str(f), env={})
        assert exc.value.key == "policy.rules"
    f.write_text("[policy]\nexit_s = -0.5\n")
    with pytest.raises(ConfigError, match="must be between 0 and 3600 s") as exc:
        load_config(str(f), env={})
    assert exc.value.key == "policy.exit_s"


def engaged(decisions):
    """The levers engaged at each sample."""
    return [sorted(name for name, _ in d.levers) for d in decisions]


def test_the_lever_per_signal_follows_its_rule_with_a_fake_clock():
    """Each rule engages its own levers after its enter dwell and releases them after its exit
    dwell (counted, as every run, from the level's last change); a lever two active rules
    want is held until both have recovered, with the first rule's reason."""
    cpu = Rule("cpu_load", 0.75, 0.70, levers=("cpu_share", "worker_threads"))
    netrx = Rule("netrx_cpu_share", 0.25, 0.10, levers=("cpu_share",))
    gc = Rule("gc_pause_s", 0.005, 0.001)
    p = DegradationPolicy((cpu, netrx, gc), enter_s=3 * PERIOD, exit_s=4 * PERIOD, min_change_interval=100)
    clock = iter(i * PERIOD for i in range(1000))
    p.update({}, next(clock))  # a first sample: each later one covers one period

    def feed(n, **signals):
        return [p.update(signals, next(clock)) for _ in range(n)]

    d = feed(2, cpu_load=0.95, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d) == [[], []]  # not yet: the rule's enter dwell is three periods
    d = feed(1, cpu_load=0.95, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d) == [["cpu_share", "worker_threads"]]
    assert str(dict(d[0].levers)["cpu_share"]) == "cpu_load=0.95 > 0.75"
    d = feed(3, cpu_load=0.95, netrx_cpu_share=0.5, gc_pause_s=0.05)  # a GC rule engages no lever
    assert engaged(d)[-1] == ["cpu_share", "worker_threads"]
    d = feed(4, cpu_load=0.2, netrx_cpu_share=0.5, gc_pause_s=None)  # CPU recovered, softirq still on
    assert engaged(d)[-1] == ["cpu_share"]
    assert str(dict(d[-1].levers)["cpu_share"]) == "netrx_cpu_share=0.5 > 0.25"
    d = feed(3, cpu_load=0.2, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d)[-1] == ["cpu_share"]  # held: the exit dwell is four periods
    d = feed(1, cpu_load=0.2, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d) == [[]] and d[0].level == 1  # released; the level steps down on its own schedule


def test_the_hysteresis_band_holds_a_lever_and_config_names_levers(tmp_path):
    p = DegradationPolicy((Rule("cpu_load", 0.75, 0.70, exit_s=2 * PERIOD, levers=("cpu_share",)),), enter_s=0)
    assert engaged(run(p, [0.9, 0.72, 0.72, 0.72, 0.6, 0.6])) == [["cpu_share"]] * 5 + [[]]
    cfg = PolicyConfig()
    rules = {r.signal: r for r in policy_from_config(cfg).rules}
    assert rules["cpu_load"].levers == ("cpu_share", "worker_threads")
    assert rules["netrx_cpu_share"].levers == ("cpu_share",) and rules["gc_pause_s"].levers == ()
    f = tmp_path / "t.toml"
    f.write_text('[policy.rules.cpu_load]\nlevers = ["worker_threads"]\n[policy.rules.turbo_wait_s]\nlevers = []\n')
    rules = {r.signal: r for r in policy_from_config(load_config(str(f), env={}).policy).rules}
    assert rules["cpu_load"].levers == ("worker_threads",) and rules["cpu_load"].enter == 0.35
    f.write_text('[policy.rules.cpu_load]\nlevers = ["overclock"]\n')
    with pytest.raises(ConfigError, match="cpu_load.levers: expected a list of levers from cpu_share, worker_threads"):
        load_config(str(f), env={})


def test_a_rule_raises_the_node_only_to_its_max_level_and_holds_it_there():
    """A busy CPU (its lever treats the cause) stops at pressured; turbo's own wait climbs on, and
    once it recovers the level steps back down to the cap, not below it, while the CPU stays busy."""
    cpu = Rule("cpu_load", 0.75, 0.70, max_level=1)
    wait = Rule("turbo_wait_s", 0.5, 0.25)
    p = DegradationPolicy((cpu, wait), enter_s=0.2, exit_s=0.5, min_change_interval=0)
    clock = iter(i * PERIOD for i in range(1000))

    def feed(n, **signals):
        return levels(p.update(signals, next(clock)) for _ in range(n))

    assert feed(30, cpu_load=1.0, turbo_wait_s=0.0)[-20:] == [1] * 20
    assert feed(30, cpu_load=1.0, turbo_wait_s=2.0)[-20:] == [3] * 20
    after = feed(30, cpu_load=1.0, turbo_wait_s=0.0)
    assert min(after) == 1 and after[-1] == 1 and 2 in after  # one step at a time, down to the cap
    assert feed(30, cpu_load=0.1, turbo_wait_s=0.0)[-1] == 0


def test_max_level_from_config(tmp_path):
    rules = {r.signal: r for r in policy_from_config(PolicyConfig()).rules}
    assert rules["cpu_load"].max_level == 1 and rules["netrx_cpu_share"].max_level == 1
    assert rules["gc_pause_s"].max_level == 2 and rules["turbo_wait_s"].max_level == 3
    f = tmp_path / "t.toml"
    f.write_text('[policy.rules.cpu_load]\nmax_level = "critical"\n')
    rules = {r.signal: r for r in policy_from_config(load_config(str(f), env={}).policy).rules}
    assert rules["cpu_load"].max_level == 3
    f.write_text('[policy.rules.cpu_load]\nmax_level = "normal"\n')  # its levers only
    rules = {r.signal: r for r in policy_from_config(load_config(str(f), env={}).policy).rules}
    assert rules["cpu_load"].max_level == 0
    f.write_text('[policy.rules.cpu_load]\nmax_level = "calm"\n')
    with pytest.raises(
        ConfigError, match="cpu_load.max_level: expected one of normal, pressured, degraded, critical"
    ) as exc:
        load_config(str(f), env={})
    assert exc.value.key == "policy.rules"
