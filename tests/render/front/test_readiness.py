"""The readiness policy (render/front/readiness.py): every state, and what a 503 would say."""

from __future__ import annotations

from render.front.readiness import Phase, Readiness, TierView, readiness


def test_phases_other_than_serving_are_not_ready_for_any_tier():
    for phase, status in ((Phase.LOADING, "loading"), (Phase.DRAINING, "draining"), (Phase.STOPPED, "stopped")):
        for tier in (None, "turbo", "relax"):
            r = readiness(phase, tier, TierView())
            assert not r.ready and r.status == status, (phase, tier)
    assert readiness(Phase.LOADING).retry_after_header() == {"Retry-After": "10"}
    assert readiness(Phase.STOPPED).retry_after_header() == {}
    assert readiness(Phase.SERVING) == Readiness(True, "ready")


def test_the_agent_can_make_a_tier_unready_or_shed_it_for_its_lease():
    r = readiness(
        Phase.SERVING, "turbo", TierView(unready_by_agent=True, agent_reason="level critical", lease_left_s=2.2)
    )
    assert not r.ready and r.status == "not ready" and "level critical" in r.reason
    assert r.retry_after_header() == {"Retry-After": "3"}
    r = readiness(Phase.SERVING, "relax", TierView(shed_by_agent=True, agent_reason="level critical"))
    assert not r.ready and r.status == "shed" and r.retry_after == 1.0
    assert readiness(Phase.SERVING, "fast", TierView()).ready


def test_own_queue_wait_over_half_the_objective():
    def turbo(wait):
        return readiness(Phase.SERVING, "turbo", TierView(oldest_wait_s=wait, objective_s=2.0))

    assert turbo(0.0).ready and turbo(1.0).ready
    r = turbo(1.3)
    assert not r.ready and "1.30 s" in r.reason and "2 s objective" in r.reason and r.retry_after == 1.0
    # no objective for the tier: its queue never makes it unready (the queue limit answers 429)
    assert readiness(Phase.SERVING, "relax", TierView(oldest_wait_s=900.0)).ready
