"""Tiered image-request load against a worker's HTTP API, for the demo and benchmarks.

Closed loop: each client sends one request, waits for the answer, sends the next, until the
deadline. Each request names its tier (body and X-Turbonode-Tier header) and its socket carries
the tier's DSCP, like a real client's. The demo runs it inside the client network namespace
(`python -m sandbox.loadgen URL --clients turbo=1 ...`), which prints the results as JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from turbonode.stats import percentile
from turbonode.tiers import TIER_NAMES, tos_byte

PATH = "/v1/images/generations"


@dataclass
class Outcome:
    tier: str
    status: int  # HTTP status; 0 when no answer came (connection error, timeout)
    latency: float  # seconds from sending the request to the end of the answer
    error: str = ""


class _TosConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket is marked with a TOS byte before it connects."""

    def __init__(self, host, port, tos: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.tos = tos

    def connect(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.tos)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def request_image(url: str, tier: str, size: int = 64, steps: int | None = None, timeout: float = 60) -> Outcome:
    parts = urlsplit(url)
    body = {
        "prompt": f"a {tier} tier test image",
        "n": 1,
        "size": f"{size}x{size}",
        "response_format": "b64_json",
        "tier": tier,
    }
    if steps:
        body["steps"] = steps
    conn = _TosConnection(parts.hostname, parts.port or 80, tos_byte(tier), timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", PATH, json.dumps(body), {"Content-Type": "application/json", "X-Turbonode-Tier": tier})
        resp = conn.getresponse()
        payload = resp.read()
        error = "" if resp.status == 200 else payload[:200].decode(errors="replace")
        return Outcome(tier, resp.status, time.perf_counter() - start, error)
    except OSError as exc:
        return Outcome(tier, 0, time.perf_counter() - start, str(exc))
    finally:
        conn.close()


def run_load(
    url: str,
    clients: dict[str, int],
    duration: float,
    size: int = 64,
    steps: dict[str, int] | None = None,
    timeout: float = 60,
) -> list[Outcome]:
    """`clients[tier]` closed-loop clients per tier for `duration` seconds; every outcome."""
    deadline = time.monotonic() + duration
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client(tier: str):
        while time.monotonic() < deadline:
            out = request_image(url, tier, size, (steps or {}).get(tier), timeout)
            with lock:
                outcomes.append(out)
            if out.status != 200:
                time.sleep(0.2)  # 429/503/errors: back off instead of spinning

    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t, n in clients.items() for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(duration + timeout + 5)
    return outcomes


def summarize(outcomes: list[Outcome]) -> dict[str, dict]:
    """Per tier: requests, ok, rejected (429/503), failed, p50/p99 latency of the ok ones."""
    out = {}
    for tier in TIER_NAMES:
        mine = [o for o in outcomes if o.tier == tier]
        if not mine:
            continue
        ok = [o.latency for o in mine if o.status == 200]
        rejected = sum(o.status in (429, 503) for o in mine)
        out[tier] = {
            "requests": len(mine),
            "ok": len(ok),
            "rejected": rejected,
            "failed": len(mine) - len(ok) - rejected,
            "p50_s": percentile(ok, 50),
            "p99_s": percentile(ok, 99),
        }
    return out


def _tier_count(value: str) -> tuple[str, int]:
    tier, _, n = value.partition("=")
    if tier not in TIER_NAMES or not n.isdigit():
        raise argparse.ArgumentTypeError(f"expected TIER=N with TIER one of {', '.join(TIER_NAMES)}, got {value!r}")
    return tier, int(n)


def _at_least(lo: float, kind: type = float):
    def convert(value: str):
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        return v

    return convert


def main(argv: list[str] | None = None) -> int:
    """Send tiered image requests to URL for DURATION seconds; print every outcome as JSON."""
    parser = argparse.ArgumentParser(prog="python -m sandbox.loadgen", description=main.__doc__)
    parser.add_argument("url")
    parser.add_argument(
        "--clients",
        type=_tier_count,
        action="append",
        default=[],
        metavar="TIER=N",
        help="closed-loop clients per tier (repeatable)",
    )
    parser.add_argument("--duration", type=_at_least(0.1), default=10.0, help="seconds (default 10)")
    parser.add_argument("--size", type=_at_least(8, int), default=64, help="image size in pixels (default 64)")
    parser.add_argument("--timeout", type=_at_least(0.1), default=60.0, help="seconds per request (default 60)")
    args = parser.parse_args(argv)
    outcomes = run_load(args.url, dict(args.clients), args.duration, args.size, timeout=args.timeout)
    print(json.dumps([asdict(o) for o in outcomes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
