"""The control socket: a real AF_UNIX server in front of a real engine."""

from __future__ import annotations

import gc
import json
import os
import socket
import stat
import threading
import time

import pytest
import torch

from render.front.control_server import ControlHandlers, ControlServer
from render.gc_telemetry import GcMonitor
from tests.render.helpers import make_engine, req
from turbonode import jsonrpc
from turbonode.errors import ControlError
from turbonode.jsonrpc import ControlClient
from turbonode.rpc_server import SocketInUse
from turbonode.throttle_params import THROTTLE_HELD


@pytest.fixture
def control(tmp_path):
    engine = make_engine()
    monitor = GcMonitor().install()
    path = str(tmp_path / "run" / "worker.sock")
    server = ControlServer(path, ControlHandlers(engine, monitor), group="turbonode").start()
    try:
        yield engine, monitor, path
    finally:
        server.close()
        monitor.uninstall()
    assert not os.path.exists(path)  # stop removes the socket


def raw(path, payload: bytes, answers: int) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(payload)
        f = sock.makefile("rb")
        return [json.loads(f.readline()) for _ in range(answers)]


def test_socket_mode_and_ping(control):
    _, _, path = control
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert ControlClient(path).call("ping")["pong"] is True


def test_status_shape(control):
    engine, _, path = control
    engine.submit(req("relax"))
    st = ControlClient(path).call("status")
    assert set(st["tiers"]) == {"turbo", "fast", "other", "relax"}
    assert st["tiers"]["relax"] == {
        "queued": 1,
        "in_flight": 0,
        "oldest_wait_s": st["tiers"]["relax"]["oldest_wait_s"],
        "queue_wait_p99_s": None,
    }
    assert set(st["step_time_s"]) == {"last", "p50", "p99"}
    assert st["max_batch"] == 4 and st["throttle"] is None
    assert st["memory"]["rss_bytes"] > 10**7 and st["memory"]["gpu_allocated_bytes"] is None
    assert st["backend"]["name"] == "torch" and st["uptime_s"] >= 0
    assert set(st["gc"]) == {"last_seq", "pauses", "collections_total", "pause_seconds_total"}


def test_status_reports_gc_pauses_since_the_last_call_or_a_sequence(control):
    _, monitor, path = control
    client = ControlClient(path)
    client.call("status")
    gc.collect(2)
    gc.collect(1)
    first = client.call("status")["gc"]
    gens = [p["generation"] for p in first["pauses"]]
    assert gens[-2:] == [2, 1] and all(p["pause_s"] >= 0 for p in first["pauses"])
    assert first["last_seq"] == first["pauses"][-1]["seq"]
    assert client.call("status")["gc"]["pauses"] == []  # nothing new since the previous call
    again = client.call("status", since_gc_seq=first["last_seq"] - 2)["gc"]["pauses"]
    assert [p["seq"] for p in again] == [first["last_seq"] - 1, first["last_seq"]]


def test_events_answers_at_the_first_long_pause_and_the_server_goes_on(control):
    _, _, path = control
    client = ControlClient(path, timeout=20)
    cursor = client.call("status")["gc"]["last_seq"]
    answer: dict = {}
    waiter = threading.Thread(
        target=lambda: answer.update(client.call("events", since_gc_seq=cursor, gc_pause_s=0.0, timeout_s=10))
    )
    waiter.start()
    assert ControlClient(path).call("ping")["pong"]  # a held call takes one thread, not the server
    gc.collect()
    waiter.join(15)
    assert answer["event"] == "gc_pause"
    assert answer["gc"]["pauses"] and all(p["seq"] > cursor for p in answer["gc"]["pauses"])
    assert set(answer["tiers"]) == {"turbo", "fast", "other", "relax"}


def test_events_times_out_quietly_and_answers_a_stale_cursor_at_once(control):
    _, monitor, path = control
    client = ControlClient(path)
    quiet = client.call("events", gc_pause_s=3600.0, turbo_wait_s=None, timeout_s=0.05)
    assert quiet["event"] is None and quiet["gc"]["last_seq"] == monitor.last_seq
    # a cursor from an earlier worker (further on than this one's pauses) gets an answer at once
    stale = client.call("events", since_gc_seq=monitor.last_seq + 1000, gc_pause_s=0.0, timeout_s=10)
    assert stale["event"] is None and stale["gc"]["last_seq"] < monitor.last_seq + 1000


def test_events_answers_when_the_oldest_turbo_job_waits_too_long(control):
    engine, _, path = control
    engine.submit(req("turbo"))  # the engine thread is not running: the job stays queued
    answer = ControlClient(path, timeout=20).call("events", gc_pause_s=None, turbo_wait_s=0.2, timeout_s=10)
    assert answer["event"] == "turbo_wait" and answer["tiers"]["turbo"]["oldest_wait_s"] > 0.2


@pytest.mark.parametrize(
    "params,match",
    [
        ({"timeout_s": 11}, "timeout_s must be between 0 and 10"),
        ({"timeout_s": None}, "timeout_s must be between"),
        ({"gc_pause_s": "5ms"}, "gc_pause_s must be a number"),
        ({"turbo_wait_s": -1}, "turbo_wait_s must be a number"),
        ({"since_gc_seq": 1.5}, "since_gc_seq must be an integer"),
        ({"colour": "red"}, "unexpected keyword"),
    ],
)
def test_bad_events_params_are_invalid_params(control, params, match):
    _, _, path = control
    with pytest.raises(ControlError, match=match) as info:
        ControlClient(path).call("events", **params)
    assert info.value.code == jsonrpc.INVALID_PARAMS


def test_throttle_release_and_expiry_over_the_socket(control):
    engine, _, path = control
    client = ControlClient(path)
    out = client.call(
        "throttle",
        max_batch=2,
        paused_tiers=["relax"],
        step_caps={"other": 5},
        shed_tiers=["fast"],
        reason="softirq saturation",
        ttl_s=30,
    )
    assert out["expires_in_s"] == pytest.approx(30, abs=0.5) and out["expires_at"] > 0
    st = client.call("status")
    assert st["max_batch"] == 2 and st["throttle"]["reason"] == "softirq saturation"
    assert st["throttle"]["paused_tiers"] == ["relax"] and st["throttle"]["step_caps"] == {"other": 5}
    assert client.call("release", reason="recovered") == {"released": True, "reason": "recovered", "hold": False}
    assert client.call("status")["throttle"] is None
    assert client.call("release")["released"] is False
    # a throttle nobody renews expires (the real clock, a short lease)
    client.call("throttle", max_batch=1, reason="short", ttl_s=0.2)
    assert engine.limits().max_batch == 1
    time.sleep(0.3)
    assert client.call("status")["throttle"] is None and engine.limits().max_batch == 4


def test_intra_op_threads_in_the_throttle_lower_the_engines_threads_until_it_expires(tmp_path):
    """The engine sets torch's thread count in its own thread (OpenMP's count is per thread), to
    the throttle's `intra_op_threads` while it lasts, never above what the worker was configured
    with, and back when the throttle expires; status shows both."""
    in_engine: list[int] = []  # torch's thread count, read in the engine thread at each step
    engine = make_engine(intra_op_threads=2, on_event=lambda e: in_engine.append(torch.get_num_threads()))
    monitor = GcMonitor().install()
    path = str(tmp_path / "worker.sock")
    server = ControlServer(path, ControlHandlers(engine, monitor)).start()
    engine.start()
    client = ControlClient(path)

    def one_job() -> int:
        in_engine.clear()
        engine.submit(req("turbo", steps=1)).future.result(60)
        assert len(set(in_engine)) == 1
        return in_engine[0]

    try:
        assert one_job() == 2
        out = client.call("throttle", intra_op_threads=1, reason="cpu contended", ttl_s=1)
        assert out["intra_op_threads"] == 1 and out["paused_tiers"] == []  # it limits no tier
        assert one_job() == 1
        assert client.call("status")["intra_op_threads"] == {"current": 1, "configured": 2}
        client.call("throttle", intra_op_threads=8, reason="more than configured", ttl_s=1)
        assert one_job() == 2  # never above the configured count
        client.call("throttle", intra_op_threads=1, reason="short", ttl_s=0.2)
        time.sleep(0.3)  # not renewed: expired, back to the configured count
        assert one_job() == 2 and client.call("status")["throttle"] is None
    finally:
        engine.stop()
        server.close()
        monitor.uninstall()


def test_an_operator_hold_refuses_the_agents_throttle_and_release(control):
    """A hold (`hold: true`) is changed only by another hold or a release with `hold: true`; the
    agent's calls get THROTTLE_HELD with the hold in the error's data. It still expires."""
    engine, _, path = control
    client = ControlClient(path)
    client.call("throttle", max_batch=3, reason="agent: cpu_load", ttl_s=30)
    held = client.call("throttle", max_batch=1, paused_tiers=["relax"], reason="maintenance", ttl_s=7200, hold=True)
    assert held["hold"] is True and held["expires_in_s"] == pytest.approx(7200, abs=1)
    for method, params in (("throttle", {"max_batch": 4, "reason": "agent", "ttl_s": 3}), ("release", {})):
        with pytest.raises(ControlError, match="an operator hold is in force .maintenance") as info:
            client.call(method, **params)
        assert info.value.code == THROTTLE_HELD and info.value.data["hold"]["reason"] == "maintenance"
    st = client.call("status")["throttle"]
    assert st["hold"] is True and st["reason"] == "maintenance" and engine.limits().max_batch == 1
    replaced = client.call("throttle", max_batch=2, reason="maintenance, step 2", ttl_s=60, hold=True)
    assert replaced["reason"] == "maintenance, step 2"
    assert client.call("release", reason="done", hold=True) == {"released": True, "reason": "done", "hold": True}
    assert client.call("throttle", max_batch=4, reason="agent", ttl_s=3)["hold"] is False
    # a hold nobody releases expires like any throttle
    client.call("throttle", max_batch=1, reason="short hold", ttl_s=0.2, hold=True)
    time.sleep(0.3)
    assert client.call("throttle", max_batch=3, reason="agent", ttl_s=3)["hold"] is False
    with pytest.raises(ControlError, match=r"ttl_s must be a number of seconds in \[0.001, 86400\]") as info:
        client.call("throttle", reason="too long", ttl_s=90000, hold=True)
    assert info.value.code == jsonrpc.INVALID_PARAMS
    with pytest.raises(ControlError, match=r"ttl_s must be a number of seconds in \[0.001, 3600\]"):
        client.call("throttle", reason="a lease is short", ttl_s=7200)
    with pytest.raises(ControlError, match="hold must be true or false"):
        client.call("throttle", reason="x", ttl_s=1, hold="yes")


@pytest.mark.parametrize(
    "params,match",
    [
        ({"paused_tiers": ["turbo"], "reason": "x", "ttl_s": 1}, "turbo tier cannot be throttled"),
        ({"reason": "x"}, "ttl_s"),
        ({"ttl_s": 1}, "reason"),
        ({"max_batch": "two", "reason": "x", "ttl_s": 1}, "max_batch"),
        ({"intra_op_threads": 0, "reason": "x", "ttl_s": 1}, "intra_op_threads must be an integer 1..1024"),
        # numbers JSON can carry but no worker can use: refused, never stored
        ({"max_batch": 2**64, "reason": "x", "ttl_s": 1}, "max_batch must be an integer 1..1024"),
        ({"max_batch": 1e38, "reason": "x", "ttl_s": 1}, "max_batch"),
        ({"step_caps": {"relax": 10**38}, "reason": "x", "ttl_s": 1}, "step_caps.relax must be an integer 1..200"),
        ({"step_caps": {"relax": 1e38}, "reason": "x", "ttl_s": 1}, "step_caps.relax"),
        ({"reason": "x", "ttl_s": 1e-320}, r"ttl_s must be a number of seconds in \[0.001, 3600\]"),
        ({"reason": "x", "ttl_s": 1, "colour": "red"}, "unexpected keyword"),
    ],
)
def test_bad_throttle_params_are_invalid_params(control, params, match):
    _, _, path = control
    with pytest.raises(ControlError, match=match) as info:
        ControlClient(path).call("throttle", **params)
    assert info.value.code == jsonrpc.INVALID_PARAMS


def test_malformed_oversized_and_unknown_requests_get_errors_and_the_server_goes_on(control):
    _, _, path = control
    payload = (
        b"{not json\n"
        b"[1, 2]\n"
        b'{"jsonrpc": "1.0", "id": 3, "method": "ping"}\n'
        b'{"jsonrpc": "2.0", "id": 4, "method": "reboot"}\n'
        b'{"jsonrpc": "2.0", "id": 5, "method": "status", "params": {"since_gc_seq": "x"}}\n'
        + b"x"
        * (jsonrpc.MAX_REQUEST_BYTES + 10)
        + b"\n"
        b'{"jsonrpc": "2.0", "id": 6, "method": "ping"}\n'
        b'{"jsonrpc": "2.0", "method": "ping"}\n'  # a notification: no answer
        b'{"jsonrpc": "2.0", "id": 7, "method": "ping"}\n'
    )
    answers = raw(path, payload, 8)
    codes = [a.get("error", {}).get("code") for a in answers]
    assert codes == [
        jsonrpc.PARSE_ERROR,
        jsonrpc.INVALID_REQUEST,
        jsonrpc.INVALID_REQUEST,
        jsonrpc.METHOD_NOT_FOUND,
        jsonrpc.INVALID_PARAMS,
        jsonrpc.INVALID_REQUEST,
        None,
        None,
    ]
    assert "larger than" in answers[5]["error"]["message"]
    assert answers[6]["id"] == 6 and answers[6]["result"]["pong"] is True
    assert answers[7]["id"] == 7
    assert ControlClient(path).call("ping")["pong"]  # a fresh client is served too


def test_stale_socket_is_replaced_but_a_live_one_is_not(tmp_path, control):
    _, _, live = control
    with pytest.raises(SocketInUse, match="already serving"):
        ControlServer(live, ControlHandlers(make_engine(), GcMonitor()))
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()  # bound, never listening: what a killed worker leaves behind
    server = ControlServer(stale, ControlHandlers(make_engine(), GcMonitor())).start()
    try:
        assert ControlClient(stale).call("ping")["pong"]
    finally:
        server.close()
    regular = tmp_path / "file"
    regular.write_text("not a socket")
    with pytest.raises(SocketInUse, match="not a socket"):
        ControlServer(str(regular), ControlHandlers(make_engine(), GcMonitor()))
