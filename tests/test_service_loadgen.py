"""sandbox.loadgen: the demo's tiered HTTP load, against a local stand-in HTTP server.
(The real worker is loaded by the demo and the daemon tests.)"""

from __future__ import annotations

import json
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
            seen.append((self.path, self.headers["X-Turbonode-Tier"], body))
            status = 429 if body["tier"] == "relax" else 200
            payload = b'{"data": []}'
            self.send_response(status)
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
    path, header, body = seen[0]
    assert path == loadgen.PATH and header == "turbo"
    assert body == {
        "prompt": "a turbo tier test image",
        "n": 1,
        "size": "32x32",
        "response_format": "b64_json",
        "tier": "turbo",
        "steps": 3,
    }
    conn = loadgen._TosConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), 0xB8, 5)
    conn.connect()
    assert conn.sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0xB8
    conn.close()


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
