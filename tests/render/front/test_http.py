"""The HTTP API over a real aiohttp server on loopback, the tiny model behind it."""

from __future__ import annotations

import base64
import http.client
import io
import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from render.front.http_api import SEED_DRAWN, SEND_BUFFER_BYTES, listening_socket, mark_socket, parse_generation
from render.jobs import RequestDefaults
from tests.render.helpers import get, post, serve
from turbonode.tiers import tos_byte


@pytest.fixture(scope="module")
def server():
    with serve(max_batch=4) as s:
        yield s


def png_size(b64):
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


def test_official_openai_client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:

        def generate(n):
            return client.images.generate(
                prompt="a lighthouse at dusk",
                n=n,
                size="64x64",
                response_format="b64_json",
                extra_body={"tier": "turbo", "steps": 2, "seed": 11},
            )

        result, once, again = generate(2), generate(1), generate(1)
    assert len(result.data) == 2
    assert all(png_size(d.b64_json) == (64, 64) for d in result.data)
    assert result.data[0].b64_json != result.data[1].b64_json  # seeds 11 and 12
    assert again.data[0].b64_json == once.data[0].b64_json  # same seed, same batch: the same PNG


def test_tier_and_turbonode_fields(server):
    # the tier header is a trusted balancer's alone (tests/render/accounts/test_api.py)
    status, headers, body = post(server.url, {"prompt": "x", "size": "64x64", "steps": 2, "tier": "fast"})
    assert status == 200 and headers["X-Turbonode-Tier"] == "fast"
    meta = json.loads(body)["turbonode"]
    assert meta["tier"] == "fast" and meta["steps"] == 2 and meta["state"] == "done"
    assert meta["requested_tier"] == "fast" and meta["downgraded"] is None and meta["engine_s"] > 0


def test_async_submit_poll_and_fetch(server):
    status, headers, body = post(
        server.url, {"prompt": "async", "size": "64x64", "steps": 2, "async": True, "tier": "turbo"}
    )
    assert status == 202
    job = json.loads(body)
    assert headers["Location"] == f"/v1/jobs/{job['id']}" and job["state"] in ("queued", "running", "decoding", "done")
    for _ in range(200):
        status, body = get(server.url, f"/v1/jobs/{job['id']}")
        state = json.loads(body)
        if state["state"] == "done":
            break
        time.sleep(0.05)
    assert state["progress"] == 1.0 and png_size(state["data"][0]["b64_json"]) == (64, 64)
    assert get(server.url, "/v1/jobs/job-nope")[0] == 404


def test_delete_cancels_and_frees_the_slot(server):
    engine = server.engine
    engine.throttle.set(paused_tiers=["relax"], reason="test", ttl_s=30)
    try:
        _, _, body = post(server.url, {"prompt": "later", "size": "64x64", "async": True, "tier": "relax"})
        job_id = json.loads(body)["id"]
        assert engine.snapshot()["tiers"]["relax"]["queued"] == 1
        status, body = get(server.url, f"/v1/jobs/{job_id}", method="DELETE")
        assert status == 200 and json.loads(body)["state"] == "cancelled"
        assert engine.snapshot()["tiers"]["relax"]["queued"] == 0
        assert json.loads(get(server.url, f"/v1/jobs/{job_id}")[1])["state"] == "cancelled"
    finally:
        engine.throttle.release()


def test_client_disconnect_cancels_its_job(server):
    engine = server.engine
    # other and every tier below it paused: the job waits in other's queue
    engine.throttle.set(paused_tiers=["other", "relax"], reason="test", ttl_s=30)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        body = json.dumps({"prompt": "abandoned", "size": "64x64", "tier": "other"}).encode()
        sock.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        for _ in range(100):
            if engine.snapshot()["tiers"]["other"]["queued"] == 1:
                break
            time.sleep(0.02)
        assert engine.snapshot()["tiers"]["other"]["queued"] == 1
        sock.close()
        for _ in range(100):
            if engine.snapshot()["tiers"]["other"]["queued"] == 0:
                break
            time.sleep(0.02)
        assert engine.snapshot()["tiers"]["other"]["queued"] == 0
    finally:
        engine.throttle.release()


def test_full_queue_and_shed_tier_answer_429_with_retry_after():
    with serve(queue_limit={"turbo": 1, "fast": 1, "other": 1, "relax": 1}) as s:
        # every tier below fast shed or paused: a fast request has no tier to move down to
        s.engine.throttle.set(paused_tiers=["relax"], shed_tiers=["fast", "other"], reason="overload", ttl_s=30)
        assert post(s.url, {"prompt": "a", "size": "64x64", "tier": "relax", "async": True})[0] == 202
        status, headers, body = post(s.url, {"prompt": "b", "size": "64x64", "tier": "relax", "async": True})
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["code"] == "queuefull"
        status, headers, body = post(s.url, {"prompt": "c", "size": "64x64", "tier": "fast"})
        assert status == 429 and 1 <= int(headers["Retry-After"]) <= 30
        assert "shed" in json.loads(body)["error"]["message"]
        # turbo is never shed and has its own queue
        assert post(s.url, {"prompt": "d", "size": "64x64", "tier": "turbo", "steps": 1})[0] == 200


@pytest.mark.parametrize(
    "body,raw,headers,status,fragment",
    [
        (None, b"{not json", None, 400, "not valid JSON"),
        (None, b"\xff\xfe", None, 400, "not valid JSON"),
        ([1, 2], None, None, 400, "JSON object"),
        ({}, None, None, 400, "'prompt' is required"),
        ({"prompt": "  "}, None, None, 400, "'prompt' is required"),
        ({"prompt": 5}, None, None, 400, "'prompt'"),
        ({"prompt": "x", "size": "100x64"}, None, None, 400, "multiples of 16"),
        ({"prompt": "x", "size": "big"}, None, None, 400, "WIDTHxHEIGHT"),
        ({"prompt": "x", "size": "8x8"}, None, None, 400, "between 64"),
        ({"prompt": "x", "n": 0}, None, None, 400, "'n' must be between 1 and 10"),
        ({"prompt": "x", "n": "2"}, None, None, 400, "'n' must be an integer"),
        ({"prompt": "x", "steps": 1000}, None, None, 400, "'steps'"),
        ({"prompt": "x", "seed": -1}, None, None, 400, "'seed'"),
        ({"prompt": "x", "guidance": "high"}, None, None, 400, "'guidance'"),
        ({"prompt": "x", "tier": "ultra"}, None, None, 400, "unknown tier 'ultra'"),
        ({"prompt": "x", "response_format": "url"}, None, None, 400, "b64_json only"),
        ({"prompt": "x", "stream": True}, None, None, 400, "'stream'"),
        ({"prompt": "x", "async": "yes"}, None, None, 400, "'async'"),
        ({"prompt": "x", "stepz": 3}, None, None, 400, "unknown field(s): stepz"),
        ({"prompt": "x" * 5000}, None, None, 400, "longer than"),
        (None, b"{" + b" " * (2 * 2**20) + b"}", None, 413, ""),
    ],
)
def test_bad_requests_get_4xx_with_a_message(server, body, raw, headers, status, fragment):
    got, _, answer = post(server.url, body, headers=headers, raw=raw)
    assert got == status
    message = json.loads(answer)["error"]["message"]
    assert fragment in message


def test_a_request_without_a_seed_draws_one_without_asking_the_kernel(monkeypatch):
    """os.urandom gives the GIL up: in a GC storm in the front each call is a chance to wait out a
    collection, so the intake draws seeds from a generator seeded once."""

    def no_urandom(n):
        raise AssertionError("the intake asked the kernel for randomness")

    monkeypatch.setattr("os.urandom", no_urandom)
    monkeypatch.setattr("random._urandom", no_urandom)  # what secrets' SystemRandom calls
    defaults = RequestDefaults(64, 8, {"turbo": 2}, {"turbo": 0.0})
    seeds = {parse_generation({"prompt": "x", "tier": "turbo"}, None, defaults)[0].seed for _ in range(50)}
    assert len(seeds) > 40 and all(0 <= seed < SEED_DRAWN for seed in seeds)
    assert parse_generation({"prompt": "x", "seed": 2**40}, "turbo", defaults)[0].seed == 2**40


def test_wrong_method_and_path_are_4xx_and_the_server_keeps_serving(server):
    assert get(server.url, "/v1/images/generations")[0] == 405
    assert get(server.url, "/v2/nothing")[0] == 404
    assert post(server.url, {"prompt": "still here", "size": "64x64", "steps": 1})[0] == 200


def test_healthz_and_metrics(server):
    status, body = get(server.url, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    post(server.url, {"prompt": "metered", "size": "64x64", "steps": 1, "tier": "fast"})
    status, body = get(server.url, "/metrics")
    text = body.decode()
    for name in (
        'turbonode_worker_queue_depth{tier="turbo"}',
        "turbonode_worker_in_flight",
        "turbonode_worker_step_duration_seconds_bucket",
        'turbonode_worker_request_stage_seconds_bucket{le="0.01",stage="queue_wait",tier="fast"}',
        'turbonode_worker_jobs_total{outcome="done",tier="fast"}',
        "turbonode_worker_text_cache_hits_total",
        "turbonode_worker_collector_success 1.0",
    ):
        assert name in text, name


def test_a_scrape_waiting_on_the_engine_holds_no_other_request(server):
    """/metrics asks the engine (a round trip to its process in the daemon) in a thread: while
    that answer is held back, a generation request is still served on the event loop."""
    asked, release = threading.Event(), threading.Event()
    real = server.engine.snapshot

    def held():
        asked.set()
        release.wait(60)
        return real()

    server.engine.snapshot = held
    scraped: list = []
    scrape = threading.Thread(target=lambda: scraped.append(get(server.url, "/metrics")))
    scrape.start()
    try:
        assert asked.wait(30), "the scrape never asked the engine"
        status, _, body = post(server.url, {"prompt": "meanwhile", "size": "64x64", "steps": 1, "tier": "turbo"})
        assert status == 200 and len(json.loads(body)["data"]) == 1
        assert not scraped  # answered while the scrape still waits
    finally:
        release.set()
        scrape.join(30)
        server.engine.snapshot = real
    assert scraped[0][0] == 200


def _tos_of_connection(server_port, client_port):
    """The TOS byte of the server's end of one connection, as the kernel reports it."""
    out = subprocess.run(
        ["ss", "-tnH", "--tos", "state", "established", f"( sport = :{server_port} and dport = :{client_port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    fields = [f for f in out.split() if f.startswith("tos:")]
    return int(fields[0].split(":")[1], 16) if fields else None


@pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2 'ss' not installed")
def test_response_socket_carries_the_tier_dscp(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # one keep-alive connection
    for tier in ("turbo", "relax", "fast"):
        conn.request(
            "POST",
            "/v1/images/generations",
            body=json.dumps({"prompt": "dscp", "size": "64x64", "steps": 1, "tier": tier}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        assert _tos_of_connection(server.port, conn.sock.getsockname()[1]) == tos_byte(tier), tier
    conn.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2 'ss' not installed")
def test_a_connection_starts_in_the_handshake_tier_and_a_bad_request_leaves_as_other(server):
    """Before any request names its tier the connection carries the listener's DSCP (turbo, the
    worker's default handshake_tier); an answer to a request without a valid tier goes as other."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        me = sock.getsockname()[1]
        deadline = time.monotonic() + 10
        while _tos_of_connection(server.port, me) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # accepted: the server's end exists
        assert _tos_of_connection(server.port, me) == tos_byte("turbo")
        body = b"{not json"
        head = f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 400")
        assert _tos_of_connection(server.port, me) == tos_byte("other")


def test_mark_socket_ipv4_and_ipv6():
    for family, addr, level, opt in (
        (socket.AF_INET, "127.0.0.1", socket.IPPROTO_IP, socket.IP_TOS),
        (socket.AF_INET6, "::1", socket.IPPROTO_IPV6, socket.IPV6_TCLASS),
    ):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((addr, 0))
        except OSError:
            continue  # no IPv6 loopback here
        with sock:
            assert mark_socket(sock, "turbo")
            assert sock.getsockopt(level, opt) == 0xB8
            assert mark_socket(sock, "relax") and sock.getsockopt(level, opt) == 0x20
    with socket.socket(socket.AF_UNIX) as unix:
        assert not mark_socket(unix, "turbo")


def test_accepted_sockets_take_the_whole_send_buffer():
    """A response goes into the kernel in one write: accepted sockets inherit the listener's
    fixed send buffer (the kernel doubles the value and caps it at net.core.wmem_max)."""
    wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
    listener = listening_socket("127.0.0.1", 0, "turbo")
    listener.setblocking(True)
    with listener, socket.create_connection(listener.getsockname(), timeout=10):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * min(SEND_BUFFER_BYTES, wmem_max)
