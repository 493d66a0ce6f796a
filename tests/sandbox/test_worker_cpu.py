"""sandbox/worker_cpu.py: bench/capacity.py's per-rung account of the worker's CPU time."""

from __future__ import annotations

import os
import threading
import time

from prometheus_client import generate_latest

from render.front.metrics import WorkerMetrics
from sandbox.worker_cpu import Reading, engine_counters, split, thread_cpu


def test_thread_cpu_sees_the_busy_thread_of_this_process():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    before = thread_cpu(os.getpid())
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.5)
    after = thread_cpu(os.getpid())  # while it runs: a thread that ended is no longer listed
    stop.set()
    t.join()
    assert t.native_id in after and t.native_id not in before
    assert after[t.native_id] >= 0.1  # it spun (sharing the GIL with this one) for half a second
    assert thread_cpu(2**22 + 7) == {}  # no such process


def test_engine_counters_read_the_workers_own_metrics_page():
    m = WorkerMetrics()
    m.observe_step(0.02, ["turbo", "turbo"])
    m.observe_step(0.03, ["turbo"])
    m.observe_decode(0.1)
    m.job_finished("turbo", "done")
    m.job_finished("turbo", "done")
    m.job_finished("relax", "done")
    got = engine_counters(generate_latest(m.registry).decode(), "turbo")
    assert got["steps"] == 2 and got["step_images"] == 3 and got["decodes"] == 1 and got["jobs_done"] == 2
    assert abs(got["step_s"] - 0.05) < 1e-9 and abs(got["decode_s"] - 0.1) < 1e-9


def test_split_per_image():
    before = Reading({"engine": {1: 1.0, 2: 0.5}, "front": {3: 0.2}}, 1.0, {"steps": 10, "step_images": 10})
    after = Reading(
        {"engine": {1: 1.8, 2: 0.6, 4: 0.1}, "front": {3: 0.24}},
        3.5,
        {"steps": 14, "step_images": 20, "decodes": 2, "jobs_done": 4, "step_s": 0.4, "decode_s": 0.2},
    )
    got = split(before, after, 4)
    assert round(got["engine_loop_ms"]) == 200  # the busiest thread: 0.8 s over 4 images
    assert round(got["engine_other_ms"]) == 50 and round(got["front_ms"]) == 10
    assert got["images_per_step"] == 2.5 and got["images_per_decode"] == 2.0
    assert round(got["step_wall_ms"]) == 100 and round(got["decode_wall_ms"]) == 50 and got["throttled_s"] == 2.5
