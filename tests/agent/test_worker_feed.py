"""The worker's pushes into the agent: the feed thread and the worker watcher against real AF_UNIX
servers (the small stand-in of tests/helpers.py, and the real control server in front of a
real engine), and the daemon's sampling loop woken by a GC burst in the worker.

No timed assertions: waits are bounded, and "at once" is shown by a sample period so long
that only a push can explain a second sample."""

import gc
import os
import select
import signal
import threading
import time

import pytest

from agent.actuator import Actuator
from agent.daemon import Flags, _run_loop, build_loop
from agent.loop import AgentLoop
from agent.policy import DegradationPolicy, Rule, actions_table
from agent.watchers.cpu import CpuWatcher
from agent.watchers.worker import WorkerWatcher
from agent.watchers.worker_feed import WorkerFeed
from bench.node import wait_for
from render.front.control_server import ControlHandlers, ControlServer
from render.gc_telemetry import GcMonitor
from tests.agent.helpers import agent_unit
from tests.helpers import MiniWorker
from tests.render.helpers import make_engine
from turbonode.config import Config, PolicyConfig

WAIT_S = 10  # bound on every wait; a pass takes milliseconds


def pushed(ww: WorkerWatcher) -> bool:
    """Whether the feed's eventfd fired (within WAIT_S); acknowledges it as the daemon does."""
    fd = ww.feed.efd
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(WAIT_S * 1000):
        return False
    ww.woken(fd)
    return True


def sample(ww: WorkerWatcher) -> dict:
    """The next sample that has news (bounded wait)."""
    assert wait_for(lambda: ww.due(0), WAIT_S), "the feed brought no news"
    return ww.sample(0)


@pytest.fixture
def watcher(worker):  # noqa: F811
    ww = WorkerWatcher(WorkerFeed(worker.client.path, {"gc_pause_s": 0.005, "turbo_wait_s": 0.5, "cpu_load": 0.75}))
    yield ww
    ww.close()


def test_gc_pauses_are_pushed_once_and_history_is_not_news(worker, watcher):  # noqa: F811
    worker.gc(0.5)  # before the agent looked
    first = sample(watcher)
    assert watcher.ok and first["gc_pause_s"] is None and first["step_time_p99_s"] == 0.05
    worker.gc(0.002)  # short: no push, reported with the next periodic answer
    assert sample(watcher)["gc_pause_s"] == 0.002
    worker.gc(0.007)
    worker.gc(0.009)
    assert pushed(watcher)
    sig = watcher.sample(0)
    assert sig["gc_pause_s"] == 0.009 and watcher.detail["gc_pauses"][-1]["seq"] == 4
    assert watcher.feed.pushes >= 1
    assert sample(watcher)["gc_pause_s"] is None  # nothing new since: the next answer says so


def test_turbo_wait_excursion_is_pushed_once(worker, watcher):  # noqa: F811
    excursion_is_pushed_once(worker, watcher)


def excursion_is_pushed_once(worker: MiniWorker, ww: WorkerWatcher) -> None:
    """A turbo-wait excursion wakes the loop once; its end and a new one make news again."""
    sample(ww)
    worker.set_turbo_wait(0.8)
    assert pushed(ww)
    assert ww.sample(0)["turbo_wait_s"] == 0.8
    before = ww.feed.pushes
    for _ in range(3):  # the excursion goes on: reported every period, not pushed again
        assert sample(ww)["turbo_wait_s"] == 0.8
    assert ww.feed.pushes == before
    worker.set_turbo_wait(0.1)
    assert wait_for(lambda: ww.due(0) and ww.sample(0)["turbo_wait_s"] == 0.1, WAIT_S)
    worker.set_turbo_wait(0.9)  # a new excursion is news again
    assert pushed(ww) and ww.feed.pushes == before + 1


def test_absent_worker_is_a_state_then_recovers(tmp_path):
    path = str(tmp_path / "late.sock")
    ww = WorkerWatcher(WorkerFeed(path, {"gc_pause_s": 0.005}))
    try:
        assert sample(ww) == {} and not ww.ok and "does not exist" in ww.error
        assert ww.view()["state"] == "absent"
        late = MiniWorker()
        srv = late.serve(path)
        try:
            assert wait_for(lambda: ww.due(0) and ww.sample(0) and ww.ok, WAIT_S), ww.error
            assert ww.view()["state"] == "ok"
        finally:
            srv.close()
    finally:
        ww.close()


def test_a_worker_answering_under_another_name_is_a_failed_state(tmp_path):
    """[workers.a]'s socket answered by worker b (a crossed configuration): reported, not watched."""
    path = str(tmp_path / "a.sock")
    other = MiniWorker()
    status = other.status
    other.status = lambda since_gc_seq=None: {**status(since_gc_seq), "name": "b"}
    srv = other.serve(path)
    ww = WorkerWatcher(WorkerFeed(path, {}, name="a"))
    try:
        assert sample(ww) == {} and not ww.ok and "answers as worker 'b', not 'a'" in ww.error, ww.error
    finally:
        ww.close()
        srv.close()


def test_restarted_worker_resyncs_without_stale_news(tmp_path):
    path = str(tmp_path / "w.sock")
    old = MiniWorker()
    srv = old.serve(path)
    ww = WorkerWatcher(WorkerFeed(path, {"gc_pause_s": 0.005}))
    try:
        sample(ww)
        for _ in range(5):
            old.gc(0.02)
        assert pushed(ww) and ww.sample(0)["gc_pause_s"] == 0.02
        srv.close()  # the worker dies...
        assert wait_for(lambda: ww.due(0) and (ww.sample(0) or True) and not ww.ok, WAIT_S)
        new = MiniWorker()  # ...and a new one starts: its counter starts again
        new.gc(0.3)
        srv = new.serve(path)
        assert wait_for(lambda: ww.due(0) and (ww.sample(0) or True) and ww.ok, WAIT_S), ww.error
        assert ww.signals["gc_pause_s"] is None  # the new worker's past is not news
        new.gc(0.04)
        assert pushed(ww) and ww.sample(0)["gc_pause_s"] == 0.04
    finally:
        srv.close()
        ww.close()


def test_worker_without_events_is_polled(tmp_path):
    path = str(tmp_path / "old.sock")
    old = MiniWorker(with_events=False)
    srv = old.serve(path)
    ww = WorkerWatcher(WorkerFeed(path, {"gc_pause_s": 0.005}))
    try:
        sample(ww)
        old.gc(0.05)
        assert pushed(ww)  # a polled answer that shows a long pause wakes the loop as an event would
        assert ww.sample(0).get("gc_pause_s") == 0.05
        assert ww.ok and ww.summary()["events"] is False and ww.feed.pushes == 1
    finally:
        srv.close()
        ww.close()


def test_an_excursion_first_seen_in_a_status_answer_is_pushed_once(tmp_path):
    """The periodic status can be the answer that first shows an excursion (CI, 18:30 UTC: the
    feed then took it as known and the events calls after it never woke the loop)."""
    path = str(tmp_path / "old.sock")
    old = MiniWorker(with_events=False)  # every answer is a status: the race made certain
    srv = old.serve(path)
    ww = WorkerWatcher(WorkerFeed(path, {"turbo_wait_s": 0.5}, period=0.05))
    try:
        excursion_is_pushed_once(old, ww)
    finally:
        srv.close()
        ww.close()


# ---- the real control server and the daemon's loop -----------------------------------------------


@pytest.fixture
def real_worker(tmp_path):
    """The worker's real control server in front of a real engine (not started: jobs stay queued),
    with the real GC monitor installed in this process."""
    engine = make_engine()
    monitor = GcMonitor().install()
    path = str(tmp_path / "worker.sock")
    server = ControlServer(path, ControlHandlers(engine, monitor)).start()
    try:
        yield engine, path
    finally:
        server.close()
        monitor.uninstall()


def gc_burst(objects: int = 200_000) -> None:
    """Cyclic garbage, then a full collection: a pause of milliseconds."""
    junk = []
    for _ in range(objects // 2):
        a, b = {}, {}
        a["b"], b["a"] = b, a
        junk.append(a)
    del junk
    gc.collect()


def test_gc_burst_in_the_worker_is_sampled_at_once_and_throttles(real_worker):
    engine, path = real_worker
    gc_rule = Rule("gc_pause_s", 0.0001, 0.00005, enter_s=0)  # any real full collection is long enough
    unit = agent_unit(path, (gc_rule,), ttl_s=30.0)
    ww = unit.feed
    period = 3600.0  # no tick after the first one during the test: any later sample is a push
    loop = AgentLoop([], DegradationPolicy(()), actions_table(PolicyConfig()), Actuator(), [unit], period)
    flags = Flags()
    seen: dict = {}

    def fault_then_stop():
        try:
            seen["ready"] = wait_for(ww.feed.fresh, WAIT_S)  # the worker answered the feed: it has a cursor
            gc_burst()
            seen["throttle"] = wait_for(engine.throttle.current, WAIT_S)
            seen["status"] = wait_for(lambda: (st := loop.status()["workers"]["default"])["last_change"] and st, WAIT_S)
        finally:
            flags.stop = True
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # wakes the loop's poll

    helper = threading.Thread(target=fault_then_stop)
    helper.start()
    try:
        _run_loop(loop, flags, period, "watching a test worker")
    finally:
        helper.join(WAIT_S)
        loop.shutdown(time.monotonic(), 2.0)
        ww.close()
    assert seen["ready"], ww.feed.take().error
    t = seen["throttle"]
    assert t is not None, seen.get("status")
    assert "gc_pause_s" in t.reason
    st = seen["status"]
    assert st["last_change"]["reasons"][0]["signal"] == "gc_pause_s"
    assert st["watchers"]["worker"]["pushes"] >= 1


def test_the_agents_cpu_watcher_leaves_out_the_processes_the_worker_names(real_worker, tmp_path):
    """The composition root hands the CPU watcher the pids the real worker's status names
    (here this process, where the test engine runs), so its compute is not counted as load."""
    _, path = real_worker
    cfg = Config()
    cfg.agent.worker_socket, cfg.agent.socket = path, str(tmp_path / "agent.sock")
    loop = build_loop(cfg)
    try:
        ww = loop.workers[0].feed
        cpu = next(w for w in loop.watchers if isinstance(w, CpuWatcher))
        assert wait_for(lambda: (ww.sample(time.monotonic()), ww.pids())[1], WAIT_S)
        assert list(cpu.processes.pids()) == [os.getpid()]
    finally:
        for w in loop.all_watchers():
            w.close()
