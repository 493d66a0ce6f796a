"""One client never hurts another (issue 10, section 4): hostile clients next to honest ones,
against the real aiohttp server and the real AF_UNIX control socket."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from render.front.control_server import ControlHandlers, ControlServer
from render.front.http_api import BadRequest, parse_json_body
from render.gc_telemetry import GcMonitor
from render.jobs import JobState
from tests.render.helpers import drain, make_engine, req, serve
from turbonode import jsonrpc, rpc_server
from turbonode.errors import ControlError
from turbonode.jsonrpc import ControlClient
from turbonode.rpc_server import UnixRpcServer

LONE_SURROGATE = b'"x \\ud800 y"'  # valid JSON, but no UTF-8 text: a tokenizer cannot take it


# ---- the HTTP API ----------------------------------------------------------------------


def post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/images/generations", data=body, headers={"Content-Type": content_type}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_lone_surrogate_prompt_gets_400_and_its_batch_mates_complete():
    honest = [b'{"prompt": "a red cat %d", "steps": 3, "tier": "relax"}' % i for i in range(3)]
    hostile = b'{"prompt": ' + LONE_SURROGATE + b', "steps": 3, "tier": "relax"}'
    with serve(max_batch=4) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, s.url, body) for body in [*honest, hostile]]
        answers = [f.result() for f in futures]
    *good, (status, body) = answers
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "surrogate" in body["error"]["message"]
    assert [code for code, _ in good] == [200, 200, 200], good


def test_the_encode_stage_fails_only_the_job_whose_prompt_fails():
    # Behind the HTTP edge (which refuses it), a prompt the tokenizer cannot take must still
    # fail alone: the stage retries a failed batch job by job.
    engine = make_engine(max_batch=4)
    good = [engine.submit(req("relax", steps=2, prompt=f"a cat {i}")) for i in range(3)]
    bad = engine.submit(req("relax", steps=2, prompt="x \ud800 y"))
    drain(engine, [*good, bad])
    assert bad.state is JobState.FAILED and "text encoding failed" in (bad.error or "")
    assert [j.state for j in good] == [JobState.DONE] * 3


DEEP = b"[" * 1000 + b"]" * 1000
# Codecs that codecs.lookup() knows but bytes.decode() refuses: no text encodings.
NOT_TEXT_CODECS = ["rot13", "base64", "hex", "zlib", "bz2", "uu", "quopri"]


@pytest.mark.parametrize("charset", NOT_TEXT_CODECS)
def test_a_charset_that_is_no_text_encoding_is_a_bad_request(charset):
    with pytest.raises(BadRequest, match="unsupported charset"):
        parse_json_body(b'{"prompt": "x"}', charset)


@pytest.mark.parametrize(
    "body,content_type,param,message",
    [
        (b'{"prompt": "x"}', "application/json; charset=bogus", None, "charset"),
        (b'{"prompt": "x"}', "application/json; charset=rot13", None, "charset"),
        ('{"prompt": "x", "size": "²x64"}'.encode(), "application/json", "size", "WIDTHxHEIGHT"),
        (DEEP, "application/json", None, "nested"),
        (b'{"prompt": "x", "n": ' + DEEP + b"}", "application/json", None, "nested"),
        (b'{"prompt": "x", "size": ' + b"[" * 500 + b"]" * 500 + b"}", "application/json", "size", "size"),
        (b'{"prompt": "x", "tier": "' + b"t" * 100_000 + b'"}', "application/json", "tier", "unknown tier"),
        (b'{"prompt": "x", "negative_prompt": ' + LONE_SURROGATE + b"}", "application/json", "negative_prompt", ""),
    ],
    ids=[
        "bogus-charset",
        "rot13-charset",
        "superscript-size",
        "nested-1000",
        "nested-field",
        "nested-500-echoed",
        "huge-tier",
        "neg",
    ],
)
def test_hostile_bodies_get_400_with_a_short_message(body, content_type, param, message):
    with serve() as s:
        status, answer = post(s.url, body, content_type)
        ok, _ = post(s.url, b'{"prompt": "a red cat", "steps": 2, "tier": "turbo"}')
    assert status == 400, answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"]
    assert len(answer["error"]["message"]) < 400  # a bad value is quoted, never echoed whole
    assert ok == 200  # and the worker goes on serving


# ---- the control socket ----------------------------------------------------------------


@pytest.fixture
def control(tmp_path):
    engine = make_engine()
    path = str(tmp_path / "worker.sock")
    server = ControlServer(path, ControlHandlers(engine, GcMonitor())).start()
    try:
        yield server, path
    finally:
        server.close()


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def test_deep_nesting_gets_a_json_rpc_error_and_the_connection_goes_on(control, capfd):
    _, path = control
    deep = b"[" * 5000 + b"]" * 5000
    with connect(path) as sock:
        sock.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": ' + deep + b"}\n")
        sock.sendall(b'{"jsonrpc": "2.0", "id": 2, "method": "ping"}\n')
        f = sock.makefile("rb")
        first, second = json.loads(f.readline()), json.loads(f.readline())
    assert first["error"]["code"] == jsonrpc.PARSE_ERROR and "nested" in first["error"]["message"]
    assert second["id"] == 2 and second["result"]["pong"] is True
    assert "Traceback" not in capfd.readouterr().err


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading whatever it said last), or None."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:  # closed with our unread bytes in its buffer: the kernel sends RST
        pass
    return time.monotonic() - t0


def test_idle_and_trickling_connections_time_out(control):
    server, path = control
    server.request_timeout = 0.5
    idle, slow = connect(path), connect(path)
    stop = threading.Event()

    def trickle():  # a byte every 0.1 s: each read is quick, the request never completes
        while not stop.wait(0.1):
            try:
                slow.send(b" ")
            except OSError:
                return

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        assert closed_within(idle, 5) is not None
        assert closed_within(slow, 5) is not None
    finally:
        stop.set()
        thread.join()
        idle.close()
        slow.close()
    assert ControlClient(path).call("ping")["pong"] is True


def test_hostile_connections_never_lock_honest_callers_out(control):
    _, path = control
    # More slow clients than the server has connection slots, each sending a byte now and then.
    hostile = [connect(path) for _ in range(rpc_server.MAX_CONNECTIONS + 8)]
    try:
        for sock in hostile:
            try:
                sock.send(b"{")
            except OSError:
                pass  # already closed to make room: fine
        time.sleep(0.2)

        def honest(_: int) -> object:
            return ControlClient(path).call("ping")["pong"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(honest, range(40)))
    finally:
        for sock in hostile:
            sock.close()
    assert answers == [True] * 40


@pytest.mark.parametrize("server_kind", ["worker", "agent"])
def test_a_burst_of_concurrent_callers_is_served(tmp_path, server_kind):
    path = str(tmp_path / "burst.sock")
    if server_kind == "worker":
        server: UnixRpcServer = ControlServer(path, ControlHandlers(make_engine(), GcMonitor())).start()
    else:  # the agent's status socket: the same transport
        server = UnixRpcServer(path, {"ping": lambda: "pong"}, owner="agent").start()
    start = threading.Barrier(16)
    errors: list[str] = []

    def caller() -> None:
        start.wait()
        for _ in range(20):
            try:
                ControlClient(path).call("ping")
            except ControlError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=caller) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.close()
    assert errors == [], f"{len(errors)} of 320 calls failed: {errors[:3]}"


def test_the_client_waits_out_a_full_listen_backlog(tmp_path):
    """AF_UNIX fails connect() at once with EAGAIN while the backlog is full: ControlClient retries
    within its timeout instead of failing the call."""
    path = str(tmp_path / "slow.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    fillers = []
    for _ in range(8):  # fill the backlog: connects now fail with EAGAIN
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    else:
        pytest.fail("the backlog never filled")

    def serve_late() -> None:
        time.sleep(0.5)  # the accept loop catches up after the client has found the backlog full
        listener.settimeout(5)
        for _ in range(len(fillers) + 1):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            line = conn.makefile("rb").readline()
            if line:
                req = json.loads(line)
                conn.sendall(jsonrpc.encode(jsonrpc.result_response(req["id"], "pong")))
            conn.close()

    thread = threading.Thread(target=serve_late, daemon=True)
    thread.start()
    try:
        for s in fillers:
            s.close()  # closed, but still queued for accept
        assert ControlClient(path, timeout=5).call("ping") == "pong"
    finally:
        thread.join(10)
        listener.close()
