"""sandbox.loadgen: the demo's tiered HTTP load, against a local stand-in HTTP server.
(The real worker is loaded by the demo and the daemon tests.)"""

from __future__ import annotations

import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sandbox import loadgen
from turbonode.stats import percentile


@pytest.fixture
def server():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["X-Turbonode-Tier"], body, self.headers["Authorization"]))
            status = 429 if body["tier"] == "relax" else 200
            payload = b'{"data": []}'
            self.send_response(status)
            if self.headers["Authorization"] == "Bearer tn-spent":  # as a worker tells a downgrade
                self.send_header("X-Turbonode-Tier", "relax")
                self.send_header("X-Turbonode-Downgraded", "budget")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def test_request_marks_tier_in_body_header_and_tos(server):
    url, seen = server
    out = loadgen.request_image(url, "turbo", size=32, steps=3)
    assert out.status == 200 and out.latency > 0
    path, header, body, authorization = seen[0]
    assert path == loadgen.PATH and header == "turbo" and authorization is None
    assert body == {
        "prompt": "a turbo tier test image",
        "n": 1,
        "size": "32x32",
        "response_format": "b64_json",
        "tier": "turbo",
        "steps": 3,
    }
    conn = loadgen.TierConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), 0xB8, 5)
    conn.connect()
    assert conn.sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0xB8
    assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1  # headers and body: no Nagle wait
    conn.close()
    assert out.connect_s is not None and out.first_byte_s is not None and out.kind == "closed"


def test_run_load_and_summary(server):
    url, _ = server
    outcomes = loadgen.run_load(url, {"turbo": 2, "relax": 1}, duration=0.5)
    summary = loadgen.summarize(outcomes)
    assert set(summary) == {"turbo", "relax"}
    assert (
        summary["turbo"]["ok"] == summary["turbo"]["requests"] > 2
        and summary["turbo"]["p99_s"] >= summary["turbo"]["p50_s"]
    )
    assert summary["relax"]["rejected"] == summary["relax"]["requests"] >= 1 and summary["relax"]["p50_s"] is None
    dead = loadgen.request_image("http://127.0.0.1:1", "fast", timeout=2)
    assert dead.status == 0 and dead.error


def test_open_loop_probes_and_honest_backoff(server):
    """Probes arrive at their own Poisson times (turbo); the closed-loop relax client, refused
    with 429, backs off instead of spinning; images/s over the run's wall time."""
    url, seen = server
    outcomes = loadgen.run_load(url, {"relax": 1}, probes=8, rate=20.0, seed=3)
    probes = [o for o in outcomes if o.kind == "probe"]
    assert len(probes) == 8 and {o.tier for o in probes} == {"turbo"} and all(o.status == 200 for o in probes)
    assert [o.sent_at for o in probes] == sorted(o.sent_at for o in probes)
    relax = [o for o in outcomes if o.tier == "relax"]
    assert 1 <= len(relax) <= 1 + probes[-1].sent_at / loadgen.BACKOFF_S + 1
    summary = loadgen.summarize(outcomes, wall_s=2.0)
    assert summary["turbo"]["images_per_s"] == 4.0 and summary["turbo"]["max_s"] >= summary["turbo"]["p99_s"]


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99


def test_cli(server, capsys):
    url, _ = server
    assert loadgen.main([url, "--clients", "fast=1", "--duration", "0.3"]) == 0
    assert {o["tier"] for o in json.loads(capsys.readouterr().out)} == {"fast"}
    with pytest.raises(SystemExit) as exc:
        loadgen.main([url, "--clients", "gold=1"])
    assert exc.value.code == 2 and "TIER=N" in capsys.readouterr().err


def test_cli_keeps_to_the_cpus_it_is_given(server, capsys, monkeypatch):
    """--cpus pins the client before it starts (turbonode/affinity.pin_cpus, tested on its own in
    tests/render/engine/test_threads.py); a bad list is refused naming the format."""
    url, _ = server
    pinned: list[frozenset[int]] = []
    monkeypatch.setattr(loadgen, "pin_cpus", pinned.append)
    assert loadgen.main([url, "--clients", "fast=1", "--duration", "0.3", "--cpus", "0-1,3"]) == 0
    assert pinned == [frozenset({0, 1, 3})]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        loadgen.main([url, "--cpus", "one"])
    assert exc.value.code == 2 and "expected a CPU list such as '0-3,8'" in capsys.readouterr().err


def test_keys_and_what_the_answer_said(server):
    url, seen = server
    out = loadgen.request_image(url, "turbo", key=("spender", "tn-spent"))
    assert seen[-1][3] == "Bearer tn-spent"
    assert (out.account, out.served_tier, out.downgraded) == ("spender", "relax", "budget")
    outcomes = loadgen.run_load(
        url, {}, probes=4, rate=50, key=("bg", "tn-bg"), probe_keys=[("a", "tn-a"), ("b", "tn-b")], seed=1
    )
    assert sorted(o.account for o in outcomes) == ["a", "a", "b", "b"]
    assert sorted(a for *_, a in seen[-4:]) == ["Bearer tn-a", "Bearer tn-a", "Bearer tn-b", "Bearer tn-b"]


def test_the_seed_fixes_the_turbo_arrivals(server):
    """A seed sends the probes at the same times in every run (bench/node_slo.py's cells then
    differ by their fault only): the schedule random.Random(seed) draws, within the sleeps' jitter."""
    url, _ = server
    rng, due, expected = random.Random(9), 0.0, []
    for _ in range(5):
        due += rng.expovariate(5.0)
        expected.append(due)
    for seed in (9, 9):
        sent = [o.sent_at for o in loadgen.run_load(url, {}, probes=5, rate=5.0, seed=seed)]
        assert sent == pytest.approx(expected, abs=0.05)
    other = [o.sent_at for o in loadgen.run_load(url, {}, probes=5, rate=5.0, seed=10)]
    assert max(abs(a - b) for a, b in zip(other, expected, strict=True)) > 0.05
