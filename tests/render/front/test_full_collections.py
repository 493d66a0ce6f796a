"""The front's full collections out of band (render/front/full_collections.py): CPython's own
schedule handed back at stop, passes held while turbo is in the front, and, with real cyclic
garbage (bench/garbage.py), every full pass in the collector's thread, none in the allocating one."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from bench.garbage import Garbage
from render.front.full_collections import MOST_DEFERRED_DUE, OUT_OF_REACH, OVERDUE, QUIET, FullCollections
from tests.helpers import ROOT
from tests.render.helpers import post, serve

GRACE_NS = 20_000_000


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield saved
    gc.set_threshold(*saved)


def test_start_takes_threshold_2_and_stop_gives_it_back(thresholds):
    full = FullCollections()
    assert full.start() and full.thread_ids()
    assert gc.get_threshold() == (*thresholds[:2], OUT_OF_REACH)
    assert full.due_after == thresholds[2]
    full.stop()
    assert gc.get_threshold() == thresholds and not full.thread_ids()
    full.stop()  # a second stop is harmless


def test_a_collector_without_threshold_2_keeps_its_own_schedule(thresholds):
    gc.set_threshold(thresholds[0], thresholds[1], 0)  # what an incremental collector reports
    full = FullCollections()
    assert not full.start() and not full.thread_ids()
    assert gc.get_threshold() == (thresholds[0], thresholds[1], 0)


def test_due_as_cpython_counts_it():
    count = [0]
    full = FullCollections(counts=lambda: (0, 0, count[0]))
    full.due_after = 10
    assert not full.due()
    count[0] = 11  # CPython collects when the count exceeds the threshold
    assert full.due()


def test_a_due_pass_waits_for_turbo_to_leave_the_front():
    ran: list[int] = []
    full = FullCollections(most_deferred_s=5.0, collect=ran.append, counts=lambda: (0, 0, 0))
    assert full.run_due() == QUIET and ran == [2]  # nothing held: at once
    full.hold()
    full.hold()
    full.release()  # one turbo request still in the front
    threading.Timer(0.2, full.release).start()
    started = time.monotonic()
    assert full.run_due() == QUIET
    assert 0.15 < time.monotonic() - started < 2.0 and ran == [2, 2]


def test_a_pass_waits_no_longer_than_its_garbage_allows():
    count = [0, 0, 0]
    full = FullCollections(most_deferred_s=30.0, collect=lambda _generation: None, counts=lambda: tuple(count))
    full.due_after = 10
    full.hold()
    count[2] = 10 * MOST_DEFERRED_DUE + 1  # a storm on a CPU of its own: long due
    started = time.monotonic()
    assert full.run_due() == OVERDUE and time.monotonic() - started < 1.0


def test_a_pass_waits_at_most_its_bound():
    whys: list[str] = []
    full = FullCollections(
        most_deferred_s=0.2, collect=lambda _generation: None, counts=lambda: (0, 0, 0), on_run=whys.append
    )
    full.hold()  # a turbo request that never leaves
    started = time.monotonic()
    assert full.run_due() == OVERDUE
    assert 0.15 < time.monotonic() - started < 2.0 and whys == [OVERDUE]


def test_a_storm_collects_in_the_collector_thread_and_not_while_turbo_is_in(thresholds):
    collectors: list[tuple[str, int]] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            collectors.append((threading.current_thread().name, time.monotonic_ns()))

    full = FullCollections(most_deferred_s=0.5, most_deferred_due=10**6)  # the time bound alone
    garbage = Garbage().start()
    gc.callbacks.append(seen)
    try:
        full.start()
        garbage.burst(3.0)
        time.sleep(0.5)
        full.hold()  # turbo in the front: 0.3 s without a full pass (after one that may be starting)
        held = time.monotonic_ns() + GRACE_NS
        time.sleep(0.3)
        released = time.monotonic_ns()
        full.release()
        time.sleep(0.5)
    finally:
        garbage.stop()
        full.stop()
        gc.callbacks.remove(seen)
    assert collectors, collectors  # the storm's garbage was collected, in full (under load: few passes)
    assert {name for name, _ in collectors} == {"full-gc"}  # never in the thread that allocated
    assert not [at for _, at in collectors if held < at < released]


def test_a_turbo_request_holds_full_collections_until_it_ends():
    events: list[str] = []

    class Recorder:
        def hold(self) -> None:
            events.append("hold")

        def release(self) -> None:
            events.append("release")

    with serve(max_batch=4) as s:
        s.api.full_collections = Recorder()
        for tier in ("relax", "turbo"):
            status, _headers, _body = post(s.url, {"prompt": "x", "size": "64x64", "steps": 2, "tier": tier})
            assert status == 200
    assert events == ["hold", "release"]  # the turbo request's; relax holds nothing


def _front_nices(out_of_band: bool, tmp_path) -> tuple[dict[int, int], str]:
    """A real `turboctl worker run` told to yield 7: each thread's nice once serving, and /metrics."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TURBONODE_WORKER_FRONT_NICE": str(os.getpriority(os.PRIO_PROCESS, 0) + 7),
        "TURBONODE_WORKER_GC_OUT_OF_BAND": "true" if out_of_band else "false",
    }
    argv = ["worker", "run", "--model", "tiny", "--listen", "127.0.0.1:0", "--control", str(tmp_path / "w.sock")]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from turboctl import main; main()", *argv],
        env=env,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in iter(proc.stderr.readline, ""):
            if found := re.search(r"serving (http://[\d.]+:\d+)", line):
                break
        else:
            raise AssertionError(f"the worker exited: {proc.wait()}")
        task = f"/proc/{proc.pid}/task"
        nices = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(task)}
        with urllib.request.urlopen(found.group(1) + "/metrics", timeout=30) as resp:
            return nices, resp.read().decode()
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
def test_the_worker_yields_all_but_its_full_collections_thread(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nices, metrics = _front_nices(True, tmp_path)
    assert sorted(nices.values()).count(base) == 1 and set(nices.values()) == {base, base + 7}, nices
    assert "turbonode_worker_full_collections_total{node=" in metrics
    nices, _ = _front_nices(False, tmp_path)  # CPython's schedule: no such thread, every one yields
    assert set(nices.values()) == {base + 7}, nices
