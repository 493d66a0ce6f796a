"""The engine with the real tiny model, driven boundary by boundary (run_once) or threaded."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from render.jobs import JobCancelled, JobFailed, JobState, QueueFull, TierShed
from tests.render.helpers import drain, make_engine, req


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def tiers_of(event):
    return [tier for _, tier, _, _ in event["samples"]]


def test_turbo_joins_at_the_next_step_boundary():
    events = []
    engine = make_engine(max_batch=2, on_event=events.append)
    relax = [engine.submit(req("relax", steps=6, seed=i)) for i in range(4)]
    engine.run_once()
    engine.run_once()
    assert all(tiers_of(e) == ["relax", "relax"] for e in events)
    turbo = engine.submit(req("turbo", steps=2))
    engine.run_once()
    assert events[-1]["kind"] == "step" and tiers_of(events[-1])[0] == "turbo"
    drain(engine, [turbo])
    assert turbo.state is JobState.DONE
    # the turbo job took its 2 steps and its decode back to back: nothing else came between
    turbo_events = [i for i, e in enumerate(events) if "turbo" in tiers_of(e)]
    assert turbo_events == list(range(turbo_events[0], turbo_events[0] + 3))
    drain(engine, relax)
    assert all(j.state is JobState.DONE for j in relax)


def test_turbo_jobs_a_step_apart_share_one_decode():
    """Two turbo jobs a step apart: the first one's decode waits for the step that finishes the
    second, and one VAE call decodes both (two calls before, one image each)."""
    events = []
    engine = make_engine(max_batch=4, on_event=events.append)
    first = engine.submit(req("turbo", steps=2, seed=1))
    engine.run_once()
    second = engine.submit(req("turbo", steps=2, seed=2))
    drain(engine, [first, second])
    assert first.state is JobState.DONE and second.state is JobState.DONE
    decodes = [e for e in events if e["kind"] == "decode"]
    assert [len(e["samples"]) for e in decodes] == [2], [(e["kind"], tiers_of(e)) for e in events]
    assert [e["kind"] for e in events] == ["step", "step", "step", "decode"]


def test_threaded_turbo_waits_at_most_the_step_in_progress():
    """Under a relax flood, at most the relax step already under way runs before turbo's first step.

    (A decode of finished relax images may also come between when min_share's patience is
    used up; it is kept to about a step's time.)
    """
    events, lock = [], threading.Lock()

    def record(e):
        with lock:
            events.append(e)

    engine = make_engine(max_batch=4, on_event=record).start()
    try:
        relax = [engine.submit(req("relax", steps=8, seed=i, prompt=f"flood {i % 3}")) for i in range(16)]
        for _ in range(3):
            time.sleep(0.15)
            submitted = engine.clock()
            turbo = engine.submit(req("turbo", steps=2, prompt="now"))
            turbo.future.result(timeout=30)
            with lock:
                first = next(i for i, e in enumerate(events) if turbo.id in [s[0] for s in e["samples"]])
                between = [e for e in events[:first] if e["at"] > submitted]
            assert len([e for e in between if e["kind"] == "step"]) <= 1, between
            assert len(between) <= 2, between
        for j in relax:
            engine.cancel(j.id)
    finally:
        engine.stop()


def test_same_seed_same_image_and_different_seed_differs():
    engine = make_engine()
    a = engine.submit(req(seed=7))
    drain(engine, [a])
    b = engine.submit(req(seed=7))
    drain(engine, [b])
    c = engine.submit(req(seed=8))
    drain(engine, [c])
    ia, ib, ic = (j.samples[0].image for j in (a, b, c))
    assert ia.shape == (64, 64, 3) and ia.dtype == np.uint8
    assert np.array_equal(ia, ib)
    assert np.abs(ia.astype(int) - ic.astype(int)).mean() > 5
    # batched with other jobs the same seed gives the same image up to float rounding
    d = engine.submit(req(seed=7))
    others = [engine.submit(req(seed=s, prompt="another")) for s in (1, 2)]
    drain(engine, [d, *others])
    assert np.abs(d.samples[0].image.astype(int) - ia.astype(int)).max() <= 2


def test_n_images_get_consecutive_seeds():
    engine = make_engine()
    job = engine.submit(req(seed=3, n=2))
    single = engine.submit(req(seed=4))
    drain(engine, [job, single])
    assert np.abs(job.samples[1].image.astype(int) - single.samples[0].image.astype(int)).max() <= 2
    assert job.progress == 1.0


def test_throttle_max_batch_pause_and_expiry():
    clock, events = Clock(), []
    engine = make_engine(max_batch=4, clock=clock, on_event=events.append)
    engine.throttle.set(max_batch=1, paused_tiers=["relax"], reason="test", ttl_s=5)
    relax = [engine.submit(req("relax", seed=i)) for i in range(3)]
    other = [engine.submit(req("other", seed=i)) for i in range(2)]
    drain(engine, other)
    assert events and all(len(e["samples"]) == 1 for e in events)
    assert all("relax" not in tiers_of(e) for e in events)
    assert all(j.state is JobState.QUEUED for j in relax)
    assert not engine.run_once()  # relax is paused: nothing to do
    clock.t += 5.0  # nobody renewed the throttle: it expires and relax runs, batched again
    drain(engine, relax)
    assert max(len(e["samples"]) for e in events) == 3


def test_throttle_step_caps_apply_to_jobs_not_yet_started():
    engine = make_engine()
    started = engine.submit(req("relax", steps=6, seed=1))
    engine.run_once()
    engine.throttle.set(step_caps={"relax": 2}, reason="test", ttl_s=60)
    fresh = engine.submit(req("relax", steps=6, seed=2))
    drain(engine, [started, fresh])
    assert started.samples[0].total_steps == 6
    assert fresh.samples[0].total_steps == 2 and fresh.describe(0)["steps"] == 2


def test_shed_tier_and_full_queue_are_rejected_with_retry_after():
    engine = make_engine(queue_limit={"turbo": 2, "fast": 2, "other": 2, "relax": 2})
    engine.throttle.set(shed_tiers=["fast"], reason="overload", ttl_s=7)
    with pytest.raises(TierShed, match="overload") as shed:
        engine.submit(req("fast"))
    assert 1 <= shed.value.retry_after <= 7
    a, b = engine.submit(req("relax")), engine.submit(req("relax"))
    with pytest.raises(QueueFull, match="relax queue is full") as full:
        engine.submit(req("relax"))
    assert full.value.retry_after >= 1
    engine.cancel(a.id)  # cancelling a queued job frees its slot at once
    assert a.state is JobState.CANCELLED
    with pytest.raises(JobCancelled):
        a.future.result(0)
    c = engine.submit(req("relax"))
    drain(engine, [b, c])


def test_cancel_a_running_job_frees_its_slot_at_the_next_boundary():
    events = []
    engine = make_engine(max_batch=1, on_event=events.append)
    running = engine.submit(req("relax", steps=10, seed=1))
    waiting = engine.submit(req("relax", steps=2, seed=2))
    engine.run_once()
    assert running.state is JobState.RUNNING
    engine.cancel(running.id)
    engine.run_once()
    assert running.state is JobState.CANCELLED
    assert events[-1]["samples"][0][0] == waiting.id
    assert engine.snapshot()["tiers"]["relax"]["in_flight"] == 1


class FlakyBackend:
    """The real backend, except that chosen denoiser calls raise (a GPU OOM cannot happen on CPU)."""

    def __init__(self, inner, fail_calls):
        self.inner, self.fail_calls, self.calls = inner, set(fail_calls), 0
        self.device, self.dtype = inner.device, inner.dtype

    def predict(self, inputs):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner.predict(inputs)

    def decode(self, latents):
        return self.inner.decode(latents)

    def describe(self):
        return self.inner.describe()


def test_a_failing_batch_fails_its_jobs_and_the_worker_goes_on():
    from tests.render.helpers import backend

    engine = make_engine(max_batch=2, backend_=FlakyBackend(backend(), {2}))
    first = [engine.submit(req("relax", seed=i)) for i in range(2)]
    engine.run_once()
    later = engine.submit(req("relax", seed=5))
    engine.run_once()  # the second UNet call fails: both jobs in it fail
    for job in first:
        assert job.state is JobState.FAILED and "out of memory" in job.error
        with pytest.raises(JobFailed, match="out of memory"):
            job.future.result(0)
    drain(engine, [later])
    assert later.state is JobState.DONE


def test_text_embeddings_are_cached_per_prompt():
    engine = make_engine()
    jobs = [engine.submit(req(prompt="same prompt", seed=i)) for i in range(3)]
    drain(engine, jobs)
    jobs2 = [engine.submit(req(prompt="same prompt", seed=9))]
    drain(engine, jobs2)
    enc = engine.encoder
    # first boundary: "same prompt" and "" (negative) miss once; every later use hits
    assert enc.misses == 2 and enc.hits == 6 and len(enc) == 2


def test_snapshot_reports_queues_and_step_times():
    engine = make_engine()
    jobs = [engine.submit(req("relax", seed=i)) for i in range(2)] + [engine.submit(req("turbo"))]
    snap = engine.snapshot()
    assert snap["tiers"]["relax"]["queued"] == 2 and snap["tiers"]["turbo"]["queued"] == 1
    drain(engine, jobs)
    snap = engine.snapshot()
    assert snap["tiers"]["relax"] == {
        "queued": 0,
        "in_flight": 0,
        "oldest_wait_s": 0.0,
        "queue_wait_p99_s": snap["tiers"]["relax"]["queue_wait_p99_s"],
    }
    assert snap["step_time_s"]["p50"] > 0 and snap["steps_total"] >= 3


def test_whole_job_policies_run_in_the_same_engine():
    from render.batching import BatchPolicy

    events = []
    engine = make_engine(max_batch=1, policy=BatchPolicy.JOB_FIFO, on_event=events.append)
    relax = engine.submit(req("relax", steps=3))
    engine.run_once()
    turbo = engine.submit(req("turbo", steps=2))
    drain(engine, [relax, turbo])
    order = [tiers_of(e)[0] for e in events if e["kind"] == "step"]
    assert order == ["relax"] * 3 + ["turbo"] * 2  # no preemption: relax finished first


def test_only_the_newest_done_jobs_keep_their_images():
    engine = make_engine()
    engine.jobs.keep_images = 2
    jobs = [engine.submit(req("turbo", steps=1, seed=i)) for i in range(3)]
    drain(engine, jobs)
    assert jobs[0].images_dropped and jobs[0].samples[0].image is None
    assert "no longer held" in jobs[0].describe(0)["images"]
    assert all(j.samples[0].image is not None for j in jobs[1:])


def test_a_finished_job_keeps_its_record_and_images_but_no_denoising_state():
    """A worker keeps a thousand finished jobs: what each holds past its end stays in the heap."""
    engine = make_engine()
    job = engine.submit(req("fast", steps=3, n=2))
    drain(engine, [job])
    assert job.cond is None and job.uncond is None  # the encoder's cache keeps the hot ones
    for s in job.samples:
        assert s.state.scheduler is None and s.state.generator is None and s.state.latents.numel() == 0
        assert s.image is not None
    described = job.describe(0)
    assert described["steps"] == 3 and described["step"] == 3 and described["progress"] == 1.0


def test_the_engine_trims_its_heap_every_period():
    clock = Clock()
    engine = make_engine(clock=clock)
    if not engine.heap_trim.available:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    engine.start()
    try:
        time.sleep(0.3)
        assert engine.heap_trim.trims == 0  # the period has not passed on the engine's clock
        clock.t += engine.heap_trim.period_s
        deadline = time.monotonic() + 5  # the idle loop wakes at least every second
        while engine.heap_trim.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.heap_trim.trims == 1
    finally:
        engine.stop()


def test_draining_fails_queued_jobs_and_runs_paused_started_ones():
    engine = make_engine()
    running = engine.submit(req("relax", steps=3))
    engine.run_once()
    queued = engine.submit(req("relax", steps=3, seed=2))
    engine.throttle.set(paused_tiers=["relax"], reason="test", ttl_s=600)
    assert not engine.run_once()
    engine.close_intake()
    assert queued.state is JobState.FAILED and "shutting down" in queued.error
    with pytest.raises(Exception, match="shutting down"):
        engine.submit(req("turbo"))
    drain(engine, [running])  # the pause does not hold shutdown back
    assert running.state is JobState.DONE


def test_a_relax_image_is_decoded_under_a_ceaseless_stream_of_turbo_jobs():
    """Turbo jobs that arrive back to back (a closed-loop client) finish and decode all the time;
    those decodes must not restart the patience of a finished relax image, which is decoded
    after about 1/min_share boundaries, not once turbo stops."""
    events = []
    engine = make_engine(max_batch=1, min_share=0.1, on_event=events.append)
    relax = engine.submit(req("relax", steps=1, guidance=0.0))
    turbo = [engine.submit(req("turbo", steps=1, seed=0))]
    for i in range(60):
        if relax.state.terminal:
            break
        if turbo[-1].state.terminal:
            turbo.append(engine.submit(req("turbo", steps=1, seed=i + 1)))
        engine.run_once()
    assert relax.state is JobState.DONE, f"relax not decoded in 60 boundaries: {relax.state}"
    assert not turbo[-1].state.terminal or len(turbo) > 5  # turbo kept coming meanwhile
    # its step comes on min_share's credit (a step in ten, decodes of turbo between: ~20 events),
    # its decode at most 1/min_share boundaries later
    relax_decode = next(i for i, e in enumerate(events) if e["kind"] == "decode" and "relax" in tiers_of(e))
    relax_step = next(i for i, e in enumerate(events) if e["kind"] == "step" and "relax" in tiers_of(e))
    assert relax_decode - relax_step <= 11, (relax_step, relax_decode)


def test_each_job_pays_its_share_of_every_batched_call():
    """Engine seconds per job: a denoiser call split by rows (classifier-free guidance takes two),
    a decode split by images; the shares add up to the engine's own measured call times."""
    events = []
    engine = make_engine(max_batch=4, on_event=events.append)
    cfg = engine.submit(req("relax", steps=3, seed=1, guidance=7.5, n=1))
    plain = engine.submit(req("relax", steps=3, seed=2, guidance=0.0, n=2))
    drain(engine, [cfg, plain])
    shared = [e for e in events if e["kind"] == "step" and {s[0] for s in e["samples"]} == {cfg.id, plain.id}]
    assert shared, events  # they shared a denoiser call: 2 rows for cfg's image, 1 for each of plain's two
    rows = {cfg.id: 2, plain.id: 1}
    expected = {cfg.id: 0.0, plain.id: 0.0}
    for e in events:
        weights = [rows[s[0]] if e["kind"] == "step" else 1 for s in e["samples"]]
        for s, w in zip(e["samples"], weights):
            expected[s[0]] += e["seconds"] * w / sum(weights)
    assert cfg.engine_s == pytest.approx(expected[cfg.id], rel=1e-9)
    assert plain.engine_s == pytest.approx(expected[plain.id], rel=1e-9)
    assert cfg.engine_s + plain.engine_s == pytest.approx(sum(e["seconds"] for e in events), rel=1e-9)
    assert cfg.describe(0.0)["engine_s"] == round(cfg.engine_s, 6)  # the job record says it
