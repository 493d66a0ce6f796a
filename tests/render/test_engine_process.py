"""The worker's two processes: the channel between front and engine, and what each does when the
other dies (render/link.py, render/engine/host.py, render/front/remote_engine.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pickle
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from render.jobs import JobFailed, QueueFull, TierShed
from render.link import EngineGone, EngineLink, FrontLink, RemoteError, Server, pack, unpack
from tests.helpers import ROOT
from tests.render.helpers import kill_worker, metric, scrape, start_worker
from turbonode.jsonrpc import ControlClient
from turbonode.metric_names import CLIENT_CLOSED, ENGINE_CPU, ENGINE_RSS, REQUEST_DURATION, REQUESTS


def test_rejections_cross_the_channel_with_their_retry_after():
    for exc in (QueueFull("tier relax queue is full (64 jobs waiting)", retry_after=7), TierShed("shed", 3.5)):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.retry_after == exc.retry_after


def test_images_travel_as_frames_of_their_own():
    png = b"iVBOR" * 100_000
    frames = pack(("done", "job-1", "done", None, 2.0, {}, [pickle.PickleBuffer(png)]))
    assert len(frames) == 2 and len(frames[0]) < 200 and bytes(frames[1]) == png  # not copied into the pickle
    message = unpack(frames)
    assert message[:6] == ("done", "job-1", "done", None, 2.0, {}) and bytes(message[6][0]) == png


@contextlib.asynccontextmanager
async def _linked(methods: dict):
    """A FrontLink on the running loop and, in a thread, a Server (the engine's side) on real
    sockets; yields (front, server, events): what the engine sent besides replies, with whether
    each was handled on the loop's own thread."""
    events: list[tuple] = []
    loop_thread = threading.get_ident()
    front = FrontLink(lambda m: events.append((m, threading.get_ident() == loop_thread)))
    link = EngineLink(*front.endpoints)
    server = Server(link)
    server.methods = methods
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    try:
        yield front, server, events
    finally:
        if front.closed is None:
            front.cast("stop")
            serving.join(5)
            link.close(5)
            front.close(EngineGone("the test ended"))
        # else the front has seen the engine go: its side stays blocked, as in a dead process


def _run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def test_calls_answer_values_and_errors_from_the_loop_and_from_threads():
    def shed():
        raise TierShed("tier relax is shed by the node's throttle (softirq)", retry_after=4)

    def broken():
        raise KeyError("nope")

    async def front_side():
        async with _linked({"add": lambda x, y: x + y, "shed": shed, "broken": broken}) as (front, server, events):
            assert await front.call("add", 2, 3) == 5
            with pytest.raises(TierShed) as shed_info:  # the project's errors keep their type
                await front.call("shed")
            assert shed_info.value.retry_after == 4
            with pytest.raises(RemoteError, match="broken failed: KeyError"):  # others are named
                await front.call("broken")
            with pytest.raises(RemoteError, match="no method 'missing'"):
                await front.call("missing")
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, front.call_sync, "add", "a", "b") == "ab"  # from a thread
            with pytest.raises(TierShed):
                await loop.run_in_executor(None, front.call_sync, "shed")
            with pytest.raises(RuntimeError, match="blocking call of add on the event loop"):
                front.call_sync("add", 1, 1)  # would wait for itself
            assert await asyncio.gather(*(front.call("add", i, i) for i in range(50))) == [2 * i for i in range(50)]
            server.link.post(("metric", "observe_step", (0.1, ["turbo"])))
            assert await front.call("add", 0, 0) == 0  # the event was sent first: it arrived first
            assert events == [(("metric", "observe_step", (0.1, ["turbo"])), True)]  # on the loop's thread

    _run(front_side)


def test_a_call_left_unanswered_times_out_with_a_clear_error():
    release = threading.Event()

    async def front_side():
        async with _linked({"wait_idle": lambda: release.wait(10), "add": lambda x, y: x + y}) as (front, _, _):
            with pytest.raises(RemoteError, match="did not answer wait_idle within 0.2 s"):
                await front.call("wait_idle", timeout=0.2)
            call = lambda: front.call_sync("wait_idle", timeout=0.2)  # noqa: E731
            with pytest.raises(RemoteError, match="did not answer wait_idle within 0.2 s"):
                await asyncio.get_running_loop().run_in_executor(None, call)
            assert await front.call("add", 1, 2) == 3  # a blocking call runs apart: the others go on
            release.set()

    _run(front_side)


def test_the_engine_gone_fails_waiting_and_later_calls_at_once():
    async def front_side():
        async with _linked({"hang": lambda: time.sleep(2), "add": lambda x, y: x + y}) as (front, server, events):
            waiting = asyncio.ensure_future(front.call("hang"))
            loop = asyncio.get_running_loop()
            waiting_sync = loop.run_in_executor(None, front.call_sync, "hang")
            server.link.post(("done", "job-1"))  # sent before the end: still read
            await asyncio.sleep(0.3)
            front.close(EngineGone("the engine process exited (status -9)"))
            for call in (waiting, waiting_sync):
                with pytest.raises(EngineGone, match="status -9"):
                    await call
            with pytest.raises(EngineGone):  # and every later one at once
                await front.call("add", 1, 1)
            with pytest.raises(EngineGone):
                await loop.run_in_executor(None, front.call_sync, "add", 1, 1)
            with pytest.raises(EngineGone):
                front.cast("throttle", None)
            assert [m for m, _ in events] == [("done", "job-1")]

    _run(front_side)


def test_the_sockets_live_in_a_private_directory_removed_once_the_engine_answers():
    async def front_side():
        async with _linked({"add": lambda x, y: x + y}) as (front, _, _):
            where = os.path.dirname(front.endpoints[0].removeprefix("ipc://"))
            mode = os.stat(where).st_mode
            assert stat.S_IMODE(mode) == 0o700 and sorted(os.listdir(where)) == ["calls", "events"]
            assert await front.call("add", 1, 1) == 2
            assert not os.path.exists(where)  # connected both ways: nobody else can connect now
            assert await front.call("add", 2, 2) == 4

    _run(front_side)


def test_the_engines_gc_pauses_are_recorded_while_a_collection_of_the_front_starts():
    """The front's event loop records the engine's GC pauses in the histogram that its own GC
    callback feeds (render/gc_telemetry.py): a collection that starts while the loop holds the
    metric's lock runs that callback on the same thread, which must not wait for the lock (it
    would wait forever, and with it every request)."""
    code = (
        "import gc\n"
        "from prometheus_client import CollectorRegistry\n"
        "from render.gc_telemetry import GcMonitor\n"
        "from render.front.metrics import WorkerMetrics\n"
        "metrics = WorkerMetrics(CollectorRegistry())\n"
        "front = GcMonitor(observe=metrics.observe_gc).install()\n"
        "gc.set_threshold(1)  # a collection at every allocation of a container, under a lock too\n"
        "for generation in (0, 1, 2):\n"
        "    front.record(generation, 0.01)  # the engine's, as its events bring them\n"
        "print('recorded', front.collections_total > 3)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("recording the engine's GC pause deadlocked with the front's own GC callback")
    assert out.stdout.strip() == "recorded True", out.stderr


# ---- the daemon's two processes ---------------------------------------------------------------


def _generate(url, body, out):
    req = urllib.request.Request(
        url + "/v1/images/generations", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            out.append((resp.status, json.loads(resp.read())))
    except urllib.error.HTTPError as exc:
        out.append((exc.code, json.loads(exc.read())))


@pytest.mark.slow
def test_engine_killed_fails_the_waiting_request_and_the_worker_exits_for_a_restart(tmp_path):
    proc, url, control, engine = start_worker(tmp_path)
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
        kill_worker(proc)
    ((code, body),) = out
    assert code == 500 and "the engine process exited (status -9)" in body["error"]["message"]
    assert not os.path.exists(control)


@pytest.mark.slow
def test_front_killed_takes_the_engine_with_it(tmp_path):
    proc, _, _, engine = start_worker(tmp_path)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert engine.wait(10) is not None or not engine.is_running()
    finally:
        kill_worker(proc)
        if engine.is_running():
            engine.kill()
            pytest.fail("the engine process outlived the front")


def test_a_job_lost_with_the_engine_fails_and_says_why():
    from render.front.remote_engine import RemoteJob
    from render.jobs import JobRequest

    request = JobRequest("p", "turbo", 4, 1, 0.0, 64, 64)
    job = RemoteJob(None, request, "job-x", 1.0, 2.0, {"id": "job-x", "state": "queued"})  # type: ignore[arg-type]
    job.lost("the engine process exited (status -9)", 3.0)
    with pytest.raises(JobFailed, match="status -9"):
        job.future.result(0)
    described = job.describe(4.0)  # answered here: there is no engine to ask
    assert described["state"] == "failed" and described["error"] == "the engine process exited (status -9)"
    assert described["id"] == "job-x" and described["elapsed_s"] == 2.0


def _raw_generation(url: str, body: dict) -> socket.socket:
    """A keep-alive POST of a generation on a plain socket, sent; the socket, to read the answer from."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    conn = socket.create_connection((host, int(port)), timeout=60)
    head = f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    conn.sendall(f"{head}Content-Length: {len(data)}\r\nConnection: keep-alive\r\n\r\n".encode() + data)
    return conn


def _read_to_close(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    conn.close()
    return b"".join(chunks)


@pytest.mark.slow
def test_a_sync_answer_comes_from_the_engine_process_while_the_front_is_frozen(tmp_path):
    """The front hands the connection to the engine process with the job: with the front stopped
    (SIGSTOP: as frozen as a collection holds it) while the job runs, the answer still arrives,
    whole, and closes the connection; the front, let go, serves the next request."""
    proc, url, _, _ = start_worker(tmp_path)
    try:
        # ~4 s here (200 steps of 256x256): it is in the engine, running, well before the stop
        conn = _raw_generation(url, {"prompt": "frozen front", "size": "256x256", "tier": "turbo", "steps": 200})
        deadline = time.monotonic() + 30
        while not metric(scrape(url), "turbonode_worker_in_flight", tier="turbo"):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            raw = _read_to_close(conn)
            answered_after = time.monotonic() - stopped
        finally:
            proc.send_signal(signal.SIGCONT)
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        assert lines[0] == "HTTP/1.1 200 OK" and headers["Connection"] == "close", head
        assert headers["X-Turbonode-Tier"] == "turbo" and int(headers["Content-Length"]) == len(body)
        answer = json.loads(body)
        assert base64.b64decode(answer["data"][0]["b64_json"]).startswith(b"\x89PNG")
        assert answer["data"][0]["revised_prompt"] == "frozen front" and answer["turbonode"]["state"] == "done"
        # most of the job ran after the front stopped: the engine process alone finished and answered it
        assert answered_after > answer["turbonode"]["elapsed_s"] / 2, (answered_after, answer["turbonode"])
        # how long the engine took to make the answer after the job's end (its PNG encoded) is in it
        assert 0 <= answer["turbonode"]["answer_s"] < answered_after, answer["turbonode"]
        # the client had its answer and closed before the front woke: still an ok answer, not a cancel
        deadline = time.monotonic() + 10
        while not metric(text := scrape(url), REQUESTS + "_total", tier="turbo", code="200"):
            assert time.monotonic() < deadline, "the answer was never counted"
            time.sleep(0.1)
        assert metric(text, REQUESTS + "_total", tier="turbo", code=str(CLIENT_CLOSED)) == 0
        assert metric(text, REQUEST_DURATION + "_count", tier="turbo", outcome="ok") == 1
        out: list = []
        _generate(url, {"prompt": "next", "size": "64x64", "tier": "turbo", "steps": 2}, out)
        assert out[0][0] == 200 and len(out[0][1]["data"]) == 1, out
    finally:
        kill_worker(proc)


@pytest.mark.slow
def test_a_sync_answer_takes_the_pixels_with_it_and_an_async_job_keeps_them(tmp_path):
    proc, url, _, _ = start_worker(tmp_path)
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
        kill_worker(proc)
