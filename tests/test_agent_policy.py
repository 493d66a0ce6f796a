"""The policy with a fake clock and recorded signal sequences (pure: no kernel, no sockets)."""

import random

import pytest

from agent.policy import Actions, DegradationPolicy, Rule, actions_table, policy_from_config, rules_from_config
from turbonode.config import POLICY_RULES, PolicyConfig, load_config
from turbonode.errors import ConfigError

PERIOD = 0.25
CPU = Rule("cpu_load", 0.75, 0.70)


def run(policy, values, signal="cpu_load", start=0.0):
    """Feed one value per sample period; return the decisions."""
    return [policy.update({signal: v}, start + i * PERIOD) for i, v in enumerate(values)]


def levels(decisions):
    return [d.level for d in decisions]


def changes(decisions):
    return [(i, d.previous, d.level) for i, d in enumerate(decisions) if d.changed]


def noisy(mean, sd, n, seed=4):
    rng = random.Random(seed)
    return [min(1.0, max(0.0, mean + rng.gauss(0, sd))) for _ in range(n)]


def test_healthy_noise_with_spikes_over_threshold_changes_nothing():
    values = noisy(0.65, 0.05, 4 * 60 * 5)  # 5 minutes of samples
    assert sum(v > 0.75 for v in values) > 10  # single spikes do cross the enter threshold
    assert changes(run(DegradationPolicy((CPU,)), values)) == []


@pytest.mark.parametrize("mean", [0.70, 0.725, 0.75, 0.78])
def test_noise_around_threshold_never_flaps(mean):
    d = run(DegradationPolicy((CPU,)), noisy(mean, 0.03, 4 * 60 * 5))
    steps = [c[2] - c[1] for c in changes(d)]
    # It may escalate, but never goes back and forth: no reversal of direction.
    reversals = sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))
    assert reversals == 0, changes(d)


def test_step_change_escalates_within_enter_samples():
    p = DegradationPolicy((CPU,), enter_samples=3)
    d = run(p, [0.2] * 20 + [0.95] * 3)
    assert levels(d)[:22] == [0] * 22
    assert d[22].changed and d[22].level == 1
    assert d[22].reasons[0].signal == "cpu_load"
    assert d[22].reasons[0].value == 0.95 and d[22].reasons[0].threshold == 0.75
    assert "cpu_load=0.95 > 0.75" in d[22].describe()


def test_one_change_per_interval_and_fresh_evidence_per_step():
    p = DegradationPolicy((CPU,), enter_samples=3, min_change_interval=1.0)
    d = run(p, [0.99] * 40)  # 10 s of saturation
    ch = changes(d)
    assert [c[2] for c in ch] == [1, 2, 3]  # one step at a time, stops at critical
    times = [c[0] * PERIOD for c in ch]
    assert all(b - a >= 1.0 for a, b in zip(times, times[1:]))


def test_recovery_waits_its_dwell_step_by_step():
    p = DegradationPolicy((CPU,), enter_samples=3, exit_samples=8, min_change_interval=1.0)
    d = run(p, [0.99] * 12 + [0.1] * 40)
    ch = changes(d)
    ups = [c for c in ch if c[2] > c[1]]
    downs = [c for c in ch if c[2] < c[1]]
    top = ups[-1][2]
    assert [c[2] for c in downs] == list(range(top - 1, -1, -1))
    # The first step down needs exit_samples healthy samples after the load ended at sample 12.
    assert downs[0][0] >= 12 + 8 - 1
    # Each further step waits another full dwell.
    assert all(b[0] - a[0] >= 8 for a, b in zip(downs, downs[1:]))
    assert "below exit" in d[downs[0][0]].reasons[0].crossed


def test_hysteresis_band_holds_the_level():
    p = DegradationPolicy((CPU,), enter_samples=3, exit_samples=4)
    d = run(p, [0.9] * 3 + [0.72] * 40)  # between exit (0.70) and enter (0.75)
    assert levels(d)[-1] == 1 and len(changes(d)) == 1
    assert "cpu_load=0.72 (held until < 0.7)" in d[-1].describe()  # why the level holds, honestly
    d = run(p, [0.5] * 4, start=20)
    assert levels(d)[-1] == 0


def test_none_keeps_streak_and_counts_as_healthy():
    gc = Rule("gc_pause_s", 0.005, 0.001)
    p = DegradationPolicy((gc,), enter_samples=3, exit_samples=4)
    # Three long pauses with sample gaps where no collection ran: still "three in a row".
    d = run(p, [0.02, None, 0.03, None, None, 0.02], signal="gc_pause_s")
    assert levels(d)[-1] == 1
    d = run(p, [0.0005, 0.003], signal="gc_pause_s", start=10)  # a 3 ms pause breaks the healthy run
    d += run(p, [None] * 4, signal="gc_pause_s", start=11)
    assert levels(d)[-1] == 0


def test_silence_after_a_streak_at_the_top_level_recovers():
    # At critical no escalation clears the streak; the silence after it (None: no GC ran)
    # must still end it, or the level would stay up for good.
    gc = Rule("gc_pause_s", 0.005, 0.001)
    p = DegradationPolicy((gc,), enter_samples=3, exit_samples=4, min_change_interval=0)
    d = run(p, [0.05] * 12, signal="gc_pause_s")
    assert d[-1].level == 3
    d = run(p, [None] * 40, signal="gc_pause_s", start=10)
    assert [c[2] for c in changes(d)] == [2, 1, 0]


def test_any_active_signal_holds_level():
    wait = Rule("turbo_wait_s", 0.5, 0.25)
    p = DegradationPolicy((CPU, wait), enter_samples=2, exit_samples=2, min_change_interval=0)
    p.update({"cpu_load": 0.9, "turbo_wait_s": 0.0}, 0)
    d = p.update({"cpu_load": 0.9, "turbo_wait_s": 0.0}, 0.25)
    assert d.level == 1
    for t in range(2, 10):
        d = p.update({"cpu_load": 0.1, "turbo_wait_s": 0.8 if t < 4 else 0.4}, t * 0.25)
    assert d.level >= 1  # turbo wait stuck in its band keeps the level


def test_config_defaults_and_actions():
    cfg = PolicyConfig()
    p = policy_from_config(cfg)
    assert (
        {r.signal for r in p.rules}
        == set(POLICY_RULES)
        == {"cpu_load", "gc_pause_s", "netrx_latency_p99_s", "netrx_cpu_share", "turbo_wait_s"}
    )
    cpu = next(r for r in p.rules if r.signal == "cpu_load")
    assert (cpu.enter, cpu.exit, cpu.enter_samples, cpu.exit_samples) == (0.75, 0.70, 3, 12)
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
        "[policy]\nenter_samples = 5\n"
        "[policy.rules.gc_pause_s]\nenter_samples = 1\n[policy.rules.cpu_load]\nenter = 0.9\n"
    )
    cfg = load_config(str(f), env={}).policy
    p = policy_from_config(cfg)
    rules = {r.signal: r for r in p.rules}
    # a partial table keeps the other defaults; a rule without its own dwell takes the policy's
    assert (rules["cpu_load"].enter, rules["cpu_load"].exit, rules["cpu_load"].enter_samples) == (0.9, 0.70, 5)
    assert rules["gc_pause_s"].enter_samples == 1 and rules["gc_pause_s"].exit_samples == 12
    assert p.update({"gc_pause_s": 0.02, "cpu_load": 0.1}, 0).level == 1  # one long pause suffices
    cpu = policy_from_config(cfg)
    assert levels(run(cpu, [0.95] * 5)) == [0, 0, 0, 0, 1]  # cpu_load needs five
    for text, match in [
        ("[policy.rules.cpu_load]\nenter_samples = 0\n", "cpu_load.enter_samples: must be a positive"),
        ("[policy.rules.psi]\nenter = 1\n", "unknown signal 'psi'"),
        ("[policy.rules.cpu_load]\nbogus = 1\n", "cpu_load.bogus: unknown key"),
        ("[policy.rules.cpu_load]\nexit = 0.8\n", r"cpu_load.exit: must not exceed cpu_load.enter \(0.75\)"),
        ('[policy.rules.gc_pause_s]\nenter = "5ms"\n', "gc_pause_s.enter: expected a number"),
    ]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=match) as exc:
            load_config(str(f), env={})
        assert exc.value.key == "policy.rules"


def engaged(decisions):
    """The levers engaged at each sample."""
    return [sorted(name for name, _ in d.levers) for d in decisions]


def test_the_lever_per_signal_follows_its_rule_with_a_fake_clock():
    """Each rule engages its own levers after its enter dwell and releases them after its exit
    dwell (counted, as every streak, from the level's last change); a lever two active rules
    want is held until both have recovered, with the first rule's reason."""
    cpu = Rule("cpu_load", 0.75, 0.70, levers=("cpu_share", "worker_threads"))
    netrx = Rule("netrx_cpu_share", 0.25, 0.10, levers=("cpu_share",))
    gc = Rule("gc_pause_s", 0.005, 0.001)
    p = DegradationPolicy((cpu, netrx, gc), enter_samples=3, exit_samples=4, min_change_interval=100)
    clock = iter(i * PERIOD for i in range(1000))

    def feed(n, **signals):
        return [p.update(signals, next(clock)) for _ in range(n)]

    d = feed(2, cpu_load=0.95, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d) == [[], []]  # not yet: the rule's enter dwell is three samples
    d = feed(1, cpu_load=0.95, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d) == [["cpu_share", "worker_threads"]]
    assert str(dict(d[0].levers)["cpu_share"]) == "cpu_load=0.95 > 0.75"
    d = feed(3, cpu_load=0.95, netrx_cpu_share=0.5, gc_pause_s=0.05)  # a GC rule engages no lever
    assert engaged(d)[-1] == ["cpu_share", "worker_threads"]
    d = feed(4, cpu_load=0.2, netrx_cpu_share=0.5, gc_pause_s=None)  # CPU recovered, softirq still on
    assert engaged(d)[-1] == ["cpu_share"]
    assert str(dict(d[-1].levers)["cpu_share"]) == "netrx_cpu_share=0.5 > 0.25"
    d = feed(3, cpu_load=0.2, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d)[-1] == ["cpu_share"]  # held: the exit dwell is four samples
    d = feed(1, cpu_load=0.2, netrx_cpu_share=0.01, gc_pause_s=None)
    assert engaged(d) == [[]] and d[0].level == 1  # released; the level steps down on its own schedule


def test_the_hysteresis_band_holds_a_lever_and_config_names_levers(tmp_path):
    p = DegradationPolicy((Rule("cpu_load", 0.75, 0.70, exit_samples=2, levers=("cpu_share",)),), enter_samples=1)
    assert engaged(run(p, [0.9, 0.72, 0.72, 0.72, 0.6, 0.6])) == [["cpu_share"]] * 5 + [[]]
    cfg = PolicyConfig()
    rules = {r.signal: r for r in policy_from_config(cfg).rules}
    assert rules["cpu_load"].levers == ("cpu_share", "worker_threads")
    assert rules["netrx_cpu_share"].levers == ("cpu_share",) and rules["gc_pause_s"].levers == ()
    f = tmp_path / "t.toml"
    f.write_text('[policy.rules.cpu_load]\nlevers = ["worker_threads"]\n[policy.rules.turbo_wait_s]\nlevers = []\n')
    rules = {r.signal: r for r in policy_from_config(load_config(str(f), env={}).policy).rules}
    assert rules["cpu_load"].levers == ("worker_threads",) and rules["cpu_load"].enter == 0.75
    f.write_text('[policy.rules.cpu_load]\nlevers = ["overclock"]\n')
    with pytest.raises(ConfigError, match="cpu_load.levers: expected a list of levers from cpu_share, worker_threads"):
        load_config(str(f), env={})
