"""Deadline-aware admission (render/front/admission.py): the replay of the engine's policy over its
backlog, checked against the real engine step for step; and a real worker that answers a turbo
request it would serve too late 503 + Retry-After at once (worker.refuse_unready)."""

from __future__ import annotations

import json
import time

from render.front.admission import NewJob, Prediction, predict
from render.front.readiness import Phase, TierView, readiness
from tests.helpers import readyz
from tests.render.helpers import SIZE, make_engine, metric, post, req, scrape, serve

SHAPE = [SIZE, SIZE]


def snapshot(backlog=(), *, cost=(0.1, 0.15, 0.2, 0.25), decode=0.05, p50=0.1, max_batch=4, min_share=0.1):
    """An engine snapshot's pace and backlog: step seconds for 1..4 rows of the test's shape."""
    return {
        "pace": {
            "step_cost": [[*SHAPE, rows, s] for rows, s in enumerate(cost, 1)],
            "decode_s_per_image": decode,
            "step_p50_s": p50,
            "max_batch": max_batch,
            "turbo_max_batch": max_batch,
            "min_share": min_share,
            "co_batch_slack": 0.25,
            "turbo_about": False,
            "paused": [],
            "uses_cfg": True,
            "credits": {},
            "decode_deferred": 0,
        },
        "backlog": [list(entry) for entry in backlog],
    }


def turbo(steps=2, n=1):
    return NewJob("turbo", steps, n, SIZE, SIZE, 0.0)


def test_an_idle_engine_predicts_the_jobs_own_steps_and_decode():
    p = predict(snapshot(), turbo(), 10.0)
    assert p == Prediction(2 * 0.1 + 0.05, 0)
    assert not p.misses(0.1)  # nothing ahead: admitted whatever the pace says
    # two images batch: two steps of two rows, one decode of two images
    assert predict(snapshot(), turbo(n=2), 10.0).seconds == 2 * 0.15 + 2 * 0.05
    # classifier-free guidance doubles the rows (fast's default guidance)
    assert predict(snapshot(), NewJob("fast", 2, 1, SIZE, SIZE, 7.5), 10.0).seconds == 2 * 0.15 + 0.05


def test_work_ahead_of_the_job_and_the_boundary_in_progress():
    # eight turbo images queued before it, two steps each, batches of four
    queued = [("turbo", seq, *SHAPE, 1, 2, False, 1) for seq in range(8)]
    p = predict(snapshot(queued), turbo(), 10.0)
    # the boundary in progress, two batches of four (two steps and a decode each), then its own
    assert p.ahead == 8 and round(p.seconds, 6) == round(0.1 + 2 * (2 * 0.25 + 4 * 0.05) + 2 * 0.1 + 0.05, 6)
    assert p.misses(1.5) and not p.misses(2.0)
    assert p.retry_after(1.5) == 1.0 and Prediction(4.2, 3).retry_after(2.0) == 3.0
    # the replay stops once past the limit: enough to say "later than that"
    assert 0.5 < predict(snapshot(queued), turbo(), 0.5).seconds < p.seconds


def test_lower_tiers_cost_a_turbo_job_little():
    relax = [("relax", seq, *SHAPE, 2, 8, seq < 2, 1) for seq in range(200)]
    p = predict(snapshot(relax), turbo(), 10.0)
    # the boundary in progress, its own two steps (relax rides along only while nearly free) and decode
    assert p.ahead == 0 and p.seconds <= 0.1 + 2 * 0.25 + 0.05
    # but a fast job waits behind the turbo work ahead of it, not behind relax
    queued = [("turbo", seq, *SHAPE, 1, 2, False, 1) for seq in range(200, 204)]
    fast = predict(snapshot(relax + queued), NewJob("fast", 2, 1, SIZE, SIZE, 7.5), 10.0)
    assert fast.ahead == 4 and fast.seconds > 2 * 0.25


def test_nothing_is_predicted_before_the_shape_is_measured():
    assert predict(snapshot(), NewJob("turbo", 2, 1, 2 * SIZE, 2 * SIZE, 0.0), 10.0) is None


def test_readiness_says_when_a_new_job_would_miss_its_objective():
    late = TierView(objective_s=2.0, prediction=Prediction(3.4, 6))
    r = readiness(Phase.SERVING, "turbo", late)
    assert not r.ready and r.status == "not ready" and "3.40 s" in r.reason and "6 images ahead" in r.reason
    assert r.retry_after_header() == {"Retry-After": "2"}
    assert readiness(Phase.SERVING, "turbo", TierView(objective_s=2.0, prediction=Prediction(1.9, 6))).ready
    assert readiness(Phase.SERVING, "turbo", TierView(objective_s=2.0, prediction=Prediction(3.4, 0))).ready


def test_the_replay_takes_the_engines_own_steps():
    """With every step costed one second, the prediction is the number of boundaries the real
    engine steps until the new job's images are decoded."""
    steps: list[tuple] = []
    engine = make_engine(max_batch=2, co_batch_slack=1e9, on_event=lambda e: steps.append(e["kind"]))
    backlog = [req("relax", steps=4, seed=i) for i in range(3)]
    backlog += [req("fast", steps=3, seed=i) for i in range(2)] + [req("turbo", steps=2, seed=i, n=2) for i in range(2)]
    for r in backlog:
        engine.submit(r)
    for _ in range(3):  # some of it under way
        engine.run_once()
    snap = engine.snapshot()
    snap["pace"].update(step_cost=[[*SHAPE, rows, 1.0] for rows in range(1, 5)], decode_s_per_image=0.0, step_p50_s=0)
    new = req("turbo", steps=3, seed=9)
    predicted = predict(snap, NewJob("turbo", 3, 1, SIZE, SIZE, new.guidance), 1000.0)
    job = engine.submit(new)
    steps.clear()
    for _ in range(200):
        if job.state.terminal:
            break
        engine.run_once()
    assert job.state.value == "done"
    assert predicted is not None and predicted.ahead == 2 and predicted.seconds == steps.count("step")


def test_a_turbo_request_that_would_miss_is_refused_at_once():
    """Objective 3 s, five turbo jobs of 400 steps queued (seconds each): a new turbo request gets
    503 + Retry-After before any job has waited half the objective, and /readyz?tier=turbo says why."""
    with serve(max_batch=1, api_settings={"refuse_unready": True, "slo": {"turbo": 3.0}}) as s:
        assert post(s.url, {"prompt": "warm", "tier": "turbo", "size": f"{SIZE}x{SIZE}", "steps": 2})[0] == 200
        t0 = time.monotonic()
        for i in range(5):
            s.engine.submit(req("turbo", steps=400, seed=i))
        status, headers, body = post(s.url, {"prompt": "late", "tier": "turbo", "size": f"{SIZE}x{SIZE}", "steps": 2})
        ready = readyz(s.url, "turbo")
        assert time.monotonic() - t0 < 1.5, "too slow to tell the prediction from the queue-wait rule"
        error = json.loads(body)["error"]
        assert status == 503 and error["code"] == "not_ready" and "would finish" in error["message"], body
        assert int(headers["Retry-After"]) >= 1
        assert ready[0] == 503 and "would finish" in ready[1]["reason"], ready
        assert readyz(s.url, "fast")[0] == 200  # no objective for fast here: it queues as before
        assert metric(scrape(s.url), "turbonode_worker_requests_total", tier="turbo", code="503") == 1
        s.engine.fail_all("enough")
        assert readyz(s.url, "turbo")[0] == 200  # the backlog gone: ready again
