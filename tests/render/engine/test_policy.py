"""The pure scheduling policy and the throttle lease (no model, no threads)."""

from __future__ import annotations

import pytest

from render.batching import (
    BatchPolicy,
    Candidate,
    Finished,
    Limits,
    compose_batch,
    decode_chunk,
    decode_overdue,
    estimate_cost,
    plan_boundary,
    should_decode,
)
from render.throttle import ThrottleState, make_throttle


def cands(*specs):
    """specs: (name, tier, seq[, shape, started])"""
    out = []
    for spec in specs:
        name, tier, seq, *rest = spec
        shape = rest[0] if rest else (256, 256)
        started = rest[1] if len(rest) > 1 else False
        out.append(Candidate(name, tier, shape, seq, started))
    return out


def test_highest_tier_first_then_arrival_order_up_to_max_batch():
    c = cands(
        ("r1", "relax", 0),
        ("o1", "other", 1),
        ("t1", "turbo", 5),
        ("f1", "fast", 3),
        ("t2", "turbo", 4),
        ("r2", "relax", 2),
    )
    assert compose_batch(c, Limits(4)).keys == ("t2", "t1", "f1", "o1")
    assert compose_batch(c, Limits(1)).keys == ("t2",)
    assert compose_batch(c, Limits(10)).keys == ("t2", "t1", "f1", "o1", "r1", "r2")
    assert compose_batch([], Limits(4)).keys == ()


def test_a_throttled_max_batch_holds_back_lower_tiers_never_turbos_own_batch():
    c = cands(("t1", "turbo", 0), ("t2", "turbo", 1), ("t3", "turbo", 2), ("f1", "fast", 3), ("r1", "relax", 4))
    assert compose_batch(c, Limits(1, turbo_max_batch=4)).keys == ("t1", "t2", "t3")
    assert compose_batch(c[:1] + c[3:], Limits(2, turbo_max_batch=4)).keys == ("t1", "f1")
    assert compose_batch(c[3:], Limits(1, turbo_max_batch=4)).keys == ("f1",)
    turbo = [Finished(f"t{i}", "turbo", (256, 256), i) for i in range(5)]
    assert decode_chunk(turbo, 1, None, None, turbo_max_batch=4) == ("t0", "t1", "t2", "t3")


def test_only_same_shape_batches_together():
    c = cands(("t1", "turbo", 0, (512, 512)), ("r1", "relax", 1), ("f1", "fast", 2, (512, 512)), ("r2", "relax", 3))
    assert compose_batch(c, Limits(4)).keys == ("t1", "f1")


def test_lower_tiers_join_turbo_only_while_it_costs_turbo_little():
    c = [
        Candidate("t1", "turbo", (256, 256), 5, rows=1),
        Candidate("r1", "relax", (256, 256), 0, rows=2),
        Candidate("r2", "relax", (256, 256), 1, rows=2),
    ]
    sh = (256, 256)
    # compute-bound (a CPU): 1 row 40 ms, 8 rows 110 ms -> relax would slow turbo's step: turbo alone
    assert compose_batch(c, Limits(4, step_cost={(sh, 1): 0.040, (sh, 8): 0.110})).keys == ("t1",)
    # headroom (a GPU): 8 rows cost about what 1 row costs -> relax rides along for free
    assert compose_batch(c, Limits(4, step_cost={(sh, 1): 0.040, (sh, 8): 0.044})).keys == ("t1", "r1", "r2")
    # nothing measured for this shape yet: batch, and learn
    assert compose_batch(c, Limits(4, step_cost={((512, 512), 1): 0.1})).keys == ("t1", "r1", "r2")
    # only big batches measured: turbo's own cost is extrapolated proportionally, so it runs alone first
    assert compose_batch(c, Limits(4, step_cost={(sh, 8): 0.110})).keys == ("t1",)
    # without turbo, lower tiers batch as usual
    assert compose_batch(c[1:], Limits(4, step_cost={(sh, 1): 0.040, (sh, 8): 0.110})).keys == ("r1", "r2")


def test_while_turbo_is_about_a_batch_without_it_holds_what_batching_pays_for():
    """A turbo job that arrives waits for the step in progress: lower tiers step in batches whose
    cost per image is within co_batch_slack of a full batch's, not in full ones."""
    sh = (256, 256)
    relax = [Candidate(f"r{i}", "relax", sh, i, rows=2) for i in range(6)]
    cpu = {(sh, 1): 0.027, (sh, 2): 0.055, (sh, 6): 0.106, (sh, 8): 0.134}  # the tiny model at 256 px, one thread
    # a full batch: 33.5 ms an image; two images (4 rows, 80.5 ms interpolated): 40.3 <= 41.9; one: 55
    assert compose_batch(relax, Limits(4, step_cost=cpu, turbo_about=True)).keys == ("r0", "r1")
    assert compose_batch(relax, Limits(4, step_cost=cpu)).keys == ("r0", "r1", "r2", "r3")
    fast_first = [Candidate("f1", "fast", sh, 9, rows=2), *relax]
    assert compose_batch(fast_first, Limits(4, step_cost=cpu, turbo_about=True)).keys == ("f1", "r0")
    # a GPU with headroom (8 rows cost about what 1 does): the full batch
    gpu = {(sh, 1): 0.040, (sh, 8): 0.044}
    assert compose_batch(relax, Limits(4, step_cost=gpu, turbo_about=True)).keys == ("r0", "r1", "r2", "r3")
    # nothing measured for the shape: batch, and learn
    assert compose_batch(relax, Limits(4, turbo_about=True)).keys == ("r0", "r1", "r2", "r3")
    # turbo's own batch is not capped; a starved tier's batch is
    turbo = Candidate("t1", "turbo", sh, 10, rows=1)
    assert compose_batch([turbo, *relax], Limits(4, step_cost=cpu, turbo_about=True)).keys == ("t1",)
    starved = compose_batch([turbo, *relax], Limits(4, min_share=0.1, step_cost=cpu, turbo_about=True), {"relax": 3.9})
    assert starved.keys == ("r0", "r1")


def test_estimate_cost():
    table = {2: 0.05, 8: 0.11}
    assert estimate_cost(2, table) == 0.05
    assert estimate_cost(5, table) == pytest.approx(0.08)
    assert estimate_cost(16, table) == pytest.approx(0.22)
    assert estimate_cost(1, table) == pytest.approx(0.025)
    assert estimate_cost(3, {}) is None


def test_paused_tiers_wait():
    c = cands(("r1", "relax", 0), ("o1", "other", 1), ("t1", "turbo", 2))
    assert compose_batch(c, Limits(4, paused=frozenset({"relax", "other"}))).keys == ("t1",)
    assert compose_batch(c[:2], Limits(4, paused=frozenset({"relax", "other"}))).keys == ()


def test_step_priority_preempts_started_lower_tiers():
    c = cands(("r1", "relax", 0, (256, 256), True), ("r2", "relax", 1, (256, 256), True), ("t1", "turbo", 9))
    assert compose_batch(c, Limits(2)).keys == ("t1", "r1")
    assert compose_batch(c, Limits(1)).keys == ("t1",)


def _share_of(tier, min_share, rounds=200, max_batch=4):
    """Run `rounds` boundaries with a turbo flood and relax waiting; the share of steps relax moves in."""
    c = cands(*[(f"t{i}", "turbo", i) for i in range(8)], ("r1", "relax", 100), ("r2", "relax", 101))
    credits, got = {}, 0
    for _ in range(rounds):
        comp = compose_batch(c, Limits(max_batch, min_share=min_share), credits)
        credits = comp.credits
        got += any(k.startswith(tier[0]) for k in comp.keys)
    return got / rounds


def test_min_share_keeps_lower_tiers_moving():
    assert _share_of("relax", 0.0) == 0.0
    assert 0.09 <= _share_of("relax", 0.1) <= 0.11
    assert 0.24 <= _share_of("relax", 0.25) <= 0.26


def test_min_share_is_paid_as_whole_batches_not_slots_in_turbo_batches():
    c = cands(*[(f"t{i}", "turbo", i) for i in range(8)], *[(f"r{i}", "relax", 100 + i) for i in range(8)])
    credits, batches = {}, []
    for _ in range(30):
        comp = compose_batch(c, Limits(4, min_share=0.1), credits)
        credits = comp.credits
        batches.append({k[0] for k in comp.keys})
    assert {"r"} in batches and all(b in ({"t"}, {"r"}) for b in batches)


def test_min_share_credit_is_dropped_when_the_tier_is_served_or_gone():
    c = cands(("t1", "turbo", 0), ("r1", "relax", 1))
    comp = compose_batch(c, Limits(4, min_share=0.5), {"relax": 1.0})
    assert comp.keys == ("t1", "r1") and comp.credits == {}
    assert compose_batch(c[:1], Limits(4, min_share=0.5), {"relax": 1.0}).credits == {}


def test_starved_tier_of_another_shape_gets_the_batch_eventually():
    c = cands(*[(f"t{i}", "turbo", i) for i in range(8)], ("r1", "relax", 100, (512, 512)))
    credits = {}
    for n in range(100):  # noqa: B007 - n counts the batches, read after the loop
        comp = compose_batch(c, Limits(4, min_share=0.1), credits)
        credits = comp.credits
        if "r1" in comp.keys:
            break
    assert comp.keys == ("r1",) and n < 20


def test_whole_job_fifo_never_preempts_and_ignores_tier():
    c = cands(("r1", "relax", 0, (256, 256), True), ("o1", "other", 1), ("t1", "turbo", 2))
    assert compose_batch(c, Limits(2), policy=BatchPolicy.JOB_FIFO).keys == ("r1", "o1")
    # started work stays even when the throttle lowers max_batch below it
    c2 = cands(("r1", "relax", 0, (256, 256), True), ("r2", "relax", 1, (256, 256), True), ("t1", "turbo", 2))
    assert compose_batch(c2, Limits(1), policy=BatchPolicy.JOB_FIFO).keys == ("r1", "r2")


def test_whole_job_priority_fills_free_slots_by_tier_without_preempting():
    c = cands(("r1", "relax", 0, (256, 256), True), ("o1", "other", 1), ("t1", "turbo", 2))
    assert compose_batch(c, Limits(2), policy=BatchPolicy.JOB_PRIORITY).keys == ("r1", "t1")
    assert compose_batch(c, Limits(1), policy=BatchPolicy.JOB_PRIORITY).keys == ("r1",)


def test_decode_waits_for_higher_tier_steps_but_not_forever():
    assert should_decode(["turbo"], ["relax"], 0, 0.1)
    assert should_decode(["relax"], [], 0, 0.1)
    assert should_decode(["fast"], ["fast", "relax"], 0, 0.1)
    assert not should_decode([], ["relax"], 0, 0.1)
    assert not should_decode(["relax"], ["turbo"], 0, 0.1)
    assert not should_decode(["relax"], ["turbo"], 8, 0.1)
    assert should_decode(["relax"], ["turbo"], 9, 0.1)
    assert not should_decode(["relax"], ["turbo"], 10_000, 0.0)


def test_an_overdue_decode_takes_the_oldest_jobs_images_first():
    assert not decode_overdue(8, 0.1) and decode_overdue(9, 0.1) and not decode_overdue(10_000, 0.0)
    fin = [Finished("t1", "turbo", (256, 256), 5), Finished("r1", "relax", (256, 256), 1)]
    assert decode_chunk(fin, 4, None, None) == ("t1",)
    assert decode_chunk(fin, 4, 0.1, 0.04, oldest_first=True) == ("r1", "t1")  # within a step's time


def test_decode_chunk_best_tier_first_and_bounded_below_turbo():
    fin = [
        Finished("r1", "relax", (256, 256), 0),
        Finished("r2", "relax", (256, 256), 1),
        Finished("r3", "relax", (256, 256), 2),
        Finished("f1", "fast", (128, 128), 3),
    ]
    assert decode_chunk(fin, 4, None, None) == ("f1",)
    assert decode_chunk(fin[:3], 4, None, None) == ("r1", "r2", "r3")
    # a relax decode is kept to about one step's time: 0.1 s step / 0.04 s per image -> 2
    assert decode_chunk(fin[:3], 4, 0.1, 0.04) == ("r1", "r2")
    assert decode_chunk(fin[:3], 4, 0.01, 0.04) == ("r1",)
    turbo = [Finished(f"t{i}", "turbo", (256, 256), i) for i in range(5)]
    assert decode_chunk(turbo, 4, 0.01, 0.04) == ("t0", "t1", "t2", "t3")
    assert decode_chunk(turbo[:1] + fin, 4, None, None) == ("t0",)  # turbo decodes without the others


def boundary(runnable, finished, limits=None, deferred=0):
    return plan_boundary(
        runnable, finished, limits or Limits(4, min_share=0.1), {}, deferred, BatchPolicy.STEP_PRIORITY, 0.02, 0.07
    )


def test_a_turbo_decode_waits_for_the_step_that_finishes_another_turbo_image():
    """Poisson turbo jobs finish a step apart; one VAE call for two images costs far less than two,
    so a finished turbo image waits for the step that finishes the next one, then both decode."""
    t1 = Finished("t1", "turbo", (256, 256), 1)
    last = Candidate("t2", "turbo", (256, 256), 2, started=True, last_step=True)
    first = Candidate("t3", "turbo", (256, 256), 3)
    plan = boundary([last, first], [t1])
    assert not plan.decode and plan.step is not None and plan.step.keys == ("t2", "t3")
    t2 = Finished("t2", "turbo", (256, 256), 2)
    assert boundary([first], [t1, t2]).decode == ("t1", "t2")  # nothing finishes next step: decode now
    # no wait when the next step finishes none of turbo's images of the shape
    assert boundary([first], [t1]).decode == ("t1",)
    other_shape = Candidate("t4", "turbo", (128, 128), 2, started=True, last_step=True)
    assert boundary([other_shape], [t1]).decode == ("t1",)
    relax = Candidate("r1", "relax", (256, 256), 0, started=True, last_step=True)
    assert boundary([relax], [t1]).decode == ("t1",)
    # nor once the decode is full (turbo's batch), nor when it is overdue
    full = [Finished(f"f{i}", "turbo", (256, 256), i) for i in range(4)]
    assert boundary([last], full).decode == ("f0", "f1", "f2", "f3")
    assert boundary([last], [t1], deferred=9).decode == ("t1",)
    # a lower tier's decode never waits so
    r2 = Finished("r2", "relax", (256, 256), 0)
    assert boundary([Candidate("r3", "relax", (256, 256), 1, started=True, last_step=True)], [r2]).decode == ("r2",)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_throttle_expires_unless_renewed():
    clock = Clock()
    state = ThrottleState(clock=clock, wall=lambda: 1e9)
    state.set(max_batch=2, paused_tiers=["relax"], reason="softirq", ttl_s=3)
    clock.t += 2.9
    assert state.current().max_batch == 2
    state.set(max_batch=1, reason="softirq", ttl_s=3)  # renewal replaces it whole
    clock.t += 2.9
    t = state.current()
    assert t.max_batch == 1 and t.paused_tiers == frozenset()
    assert t.describe(clock())["expires_in_s"] == pytest.approx(0.1)
    clock.t += 0.2
    assert state.current() is None and state.expired_total == 1
    state.set(reason="x", ttl_s=1)
    assert state.release() is not None and state.current() is None


@pytest.mark.parametrize(
    "params,match",
    [
        ({"paused_tiers": ["turbo"]}, "turbo tier cannot be throttled"),
        ({"shed_tiers": ["turbo"]}, "turbo tier cannot be throttled"),
        ({"step_caps": {"turbo": 2}}, "turbo tier cannot be throttled"),
        ({"paused_tiers": ["ultra"]}, "unknown tier 'ultra'"),
        ({"paused_tiers": "relax"}, "must be a list"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"step_caps": {"relax": 0}}, "step_caps.relax"),
        ({"step_caps": ["relax"]}, "step_caps must be an object"),
        ({"reason": ""}, "reason"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": 1e9}, "ttl_s"),
        ({"ttl_s": None}, "ttl_s"),
    ],
)
def test_throttle_validation_names_the_bad_parameter(params, match):
    full = {"reason": "load", "ttl_s": 3, **params}
    with pytest.raises(ValueError, match=match):
        make_throttle(now=0, now_wall=0, **full)
