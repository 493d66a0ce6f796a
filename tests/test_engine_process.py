"""The worker's two processes: the pipe between front and engine, and what each does when the
other dies (render/engine_link.py, render/engine_host.py, render/remote_engine.py)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from multiprocessing.connection import Connection

import psutil
import pytest

from render.engine_host import Server
from render.engine_link import AsyncLink, EngineGone, Frames, Link, RemoteError, frame
from render.jobs import JobFailed, QueueFull, TierShed
from tests.daemon_harness import daemon_env, start, turboctl_argv
from turbonode.jsonrpc import ControlClient
from turbonode.metric_names import ENGINE_CPU, ENGINE_RSS


def test_rejections_cross_the_pipe_with_their_retry_after():
    for exc in (QueueFull("tier relax queue is full (64 jobs waiting)", retry_after=7), TierShed("shed", 3.5)):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.retry_after == exc.retry_after


def _linked(methods: dict):
    """A Server (the engine's side) and a Link (the front's) over a real socketpair."""
    a, b = socket.socketpair()
    server = Server(Connection(b.detach()))
    server.methods = methods
    server.start_readers()
    server.start_senders()
    events: list[tuple] = []
    closed = threading.Event()
    front = Link(Connection(a.detach()), events.append, closed.set).start()
    return server, front, events, closed


def _hang_up(server) -> None:
    """The engine's end goes away, as when its process exits (a close alone leaves a blocked recv)."""
    for channel in server.channels:
        channel.post(None)
        sock = socket.socket(fileno=channel.link.conn.fileno())
        sock.shutdown(socket.SHUT_RDWR)
        sock.detach()


def test_calls_answer_values_and_errors_and_the_engine_keeps_serving():
    def shed():
        raise TierShed("tier relax is shed by the node's throttle (softirq)", retry_after=4)

    def broken():
        raise KeyError("nope")

    server, front, events, closed = _linked({"add": lambda x, y: x + y, "shed": shed, "broken": broken})
    try:
        assert front.call("add", 2, 3) == 5
        with pytest.raises(TierShed) as shed_info:  # the project's errors keep their type
            front.call("shed")
        assert shed_info.value.retry_after == 4
        with pytest.raises(RemoteError, match="broken failed: KeyError"):  # others are named
            front.call("broken")
        with pytest.raises(RemoteError, match="no method 'missing'"):
            front.call("missing")
        assert front.call("add", "a", "b") == "ab"  # still serving
        server.post(("metric", "observe_step", (0.1, ["turbo"])))
        deadline = time.monotonic() + 5
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == [("metric", "observe_step", (0.1, ["turbo"]))]
    finally:
        _hang_up(server)
    assert closed.wait(5)  # the engine's end went away: the front's link closes...
    with pytest.raises(EngineGone):  # ...and every later call says so at once
        front.call("add", 1, 1)


def test_a_call_left_unanswered_times_out_with_a_clear_error():
    release = threading.Event()
    server, front, _, _ = _linked({"wait_idle": lambda: release.wait(10), "add": lambda x, y: x + y})
    try:
        with pytest.raises(RemoteError, match="did not answer wait_idle within 0.2 s"):
            front.call("wait_idle", timeout=0.2)
        assert front.call("add", 1, 2) == 3  # a blocking call runs apart: the others go on
    finally:
        release.set()
        _hang_up(server)


def test_a_hang_up_right_after_a_reply_still_reports_the_exit():
    """The reader settles a reply, then reads EOF before the caller has taken its call off the
    pending table: closing must leave that answered call alone and still report the exit."""
    import concurrent.futures

    a, b = socket.socketpair()
    closed = threading.Event()
    front = Link(Connection(a.detach()), lambda _m: None, closed.set)
    answered: concurrent.futures.Future = concurrent.futures.Future()
    answered.set_result(5)
    front._pending[1] = answered  # answered, not yet collected by its caller
    front.start()
    b.close()
    assert closed.wait(5) and answered.result(0) == 5


def test_frames_are_cut_from_any_chunking_as_a_connection_sent_them():
    a, b = socket.socketpair()
    sent = [("reply", 1, True, {"id": "job-1"}), ("done", "job-1", "done", None, 2.0, {}, ["x" * 300_000])]
    conn = Connection(a.detach())

    def send():
        for message in sent:
            conn.send(message)
        conn.close()

    threading.Thread(target=send, daemon=True).start()  # more than the socket buffers
    stream = b""
    while chunk := b.recv(1 << 16):
        stream += chunk
    b.close()
    for size in (1, 7, 4096, len(stream)):  # byte by byte, torn headers, whole
        frames = Frames()
        got = [m for i in range(0, len(stream), size) for m in frames.feed(stream[i : i + size])]
        assert got == sent, size
    assert Frames().feed(frame(sent[1])) == [sent[1]]  # and what the front writes, a Connection reads


def _lane(methods: dict):
    """A Server whose lane is the second socketpair, and the front's AsyncLink on it (in a loop)."""
    link_a, link_b = socket.socketpair()
    lane_a, lane_b = socket.socketpair()
    server = Server(Connection(link_b.detach()), Connection(lane_b.detach()))
    server.methods = methods
    server.start_readers()
    server.start_senders()
    return server, link_a, lane_a


def test_the_lane_answers_calls_and_events_on_the_event_loop():
    def submit(x):
        server.lane.post(("ended", x))  # an event (as a job end), posted before the reply: both arrive in order
        return x * 2

    def shed():
        raise TierShed("tier relax is shed by the node's throttle (softirq)", retry_after=4)

    server, link_sock, sock = _lane({"submit": submit, "shed": shed, "hang": lambda: time.sleep(2)})
    events: list[tuple] = []

    async def front():
        link = await AsyncLink.open(sock, events.append)
        loop_thread = threading.get_ident()
        seen = []
        link._on_message = lambda m: seen.append((m, threading.get_ident() == loop_thread))
        assert await link.call("submit", 21) == 42
        assert seen == [(("ended", 21), True)]  # handled on the loop's own thread
        with pytest.raises(TierShed) as shed_info:
            await link.call("shed")
        assert shed_info.value.retry_after == 4
        with pytest.raises(RemoteError, match="did not answer hang within 0.2 s"):
            await link.call("hang", timeout=0.2)
        assert await asyncio.gather(*(link.call("submit", i) for i in range(50))) == [2 * i for i in range(50)]
        waiting = asyncio.ensure_future(link.call("hang"))
        await asyncio.sleep(0.1)
        _hang_up(server)
        with pytest.raises(EngineGone):  # the engine's end went away: the waiting call says so
            await waiting
        with pytest.raises(EngineGone):  # and every later one at once
            await link.call("submit", 1)

    try:
        asyncio.run(front())
    finally:
        link_sock.close()


# ---- the daemon's two processes ---------------------------------------------------------------


def _start_worker(tmp_path):
    control = str(tmp_path / "worker.sock")
    argv = turboctl_argv("worker", "run", "--model", "tiny", "--listen", "127.0.0.1:0", "--control", control)
    proc, out = start(argv, daemon_env(TURBONODE_WORKER_DRAIN_TIMEOUT="5"), cwd=tmp_path)
    found = out.wait_for(r"serving (http://\S+)", 120)
    assert found, f"the worker did not start (status {proc.poll()}):\n{out.text}"
    engines = psutil.Process(proc.pid).children()
    assert len(engines) == 1, engines
    return proc, found.group(1), control, engines[0]


def _generate(url, body, out):
    req = urllib.request.Request(
        url + "/v1/images/generations", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            out.append((resp.status, json.loads(resp.read())))
    except urllib.error.HTTPError as exc:
        out.append((exc.code, json.loads(exc.read())))


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_engine_killed_fails_the_waiting_request_and_the_worker_exits_for_a_restart(tmp_path):
    proc, url, control, engine = _start_worker(tmp_path)
    try:
        status = ControlClient(control).call("status")
        assert status["memory"]["rss_bytes"] > engine.memory_info().rss  # both processes counted
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        rss = re.search(rf"^{ENGINE_RSS}{{node=\S+}} (\S+)$", text, re.M)
        assert rss and float(rss.group(1)) > 10**7 and re.search(rf"^{ENGINE_CPU}{{", text, re.M), text
        out: list = []
        waiting = threading.Thread(
            target=_generate, args=(url, {"prompt": "long", "size": "64x64", "tier": "relax", "steps": 200}, out)
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while ControlClient(control).call("status")["tiers"]["relax"]["in_flight"] != 1:
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)
        engine.send_signal(signal.SIGKILL)
        waiting.join(30)
        assert proc.wait(30) == 1  # a failed worker: its service manager restarts it
    finally:
        _stop(proc)
    ((code, body),) = out
    assert code == 500 and "the engine process exited (status -9)" in body["error"]["message"]
    assert not os.path.exists(control)


@pytest.mark.slow
def test_front_killed_takes_the_engine_with_it(tmp_path):
    proc, _, _, engine = _start_worker(tmp_path)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert engine.wait(10) is not None or not engine.is_running()
    finally:
        _stop(proc)
        if engine.is_running():
            engine.kill()
            pytest.fail("the engine process outlived the front")


def test_a_job_lost_with_the_engine_fails_and_says_why():
    from render.jobs import JobRequest
    from render.remote_engine import RemoteJob

    job = RemoteJob(None, JobRequest("p", "turbo", 4, 1, 0.0, 64, 64), "job-x", 1.0, 2.0)  # type: ignore[arg-type]
    job.lost("the engine process exited (status -9)", 3.0)
    with pytest.raises(JobFailed, match="status -9"):
        job.future.result(0)
    described = job.describe(4.0)  # answered here: there is no engine to ask
    assert described["state"] == "failed" and described["error"] == "the engine process exited (status -9)"
    assert described["id"] == "job-x" and described["elapsed_s"] == 2.0


@pytest.mark.slow
def test_a_sync_answer_takes_the_pixels_with_it_and_an_async_job_keeps_them(tmp_path):
    proc, url, _, _ = _start_worker(tmp_path)
    try:
        out: list = []
        _generate(url, {"prompt": "sync", "size": "64x64", "tier": "turbo", "steps": 2}, out)
        _generate(url, {"prompt": "later", "size": "64x64", "tier": "fast", "steps": 2, "async": True}, out)
        (code, sync), (accepted, queued) = out
        assert code == 200 and len(sync["data"]) == 1 and accepted == 202, out

        def job(job_id: str, wait: str = "") -> dict:
            with urllib.request.urlopen(f"{url}/v1/jobs/{job_id}{wait}", timeout=60) as resp:
                return json.loads(resp.read())

        # the engine dropped the sync job's pixels when it sent them: nothing is held anywhere
        assert "no longer held" in job(sync["turbonode"]["id"])["images"]
        done = job(queued["id"], "?wait=30")  # the async job's are held until fetched
        assert done["state"] == "done" and len(done["data"]) == 1 and job(queued["id"])["data"] == done["data"]
    finally:
        _stop(proc)
