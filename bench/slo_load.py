"""Open-loop turbo probes plus closed-loop background load, for bench/node_slo.py.

Runs inside the sandbox's client namespace and prints every outcome as JSON. Turbo requests
arrive open-loop (Poisson, `--rate` per second, `--probes` of them): each is sent at its own
time whatever the others are doing, so a slow node cannot slow the arrivals down and hide its
tail. Background clients (`--clients TIER=N`) are closed-loop and run until the last probe
is answered. Each request's socket carries its tier's DSCP before it connects (the SYN too)
and TCP_NODELAY, as a real client's does; per request it records connect, first byte and
last byte, and the worker's own queue wait and submit-to-finish time from the answer.

    python bench/slo_load.py http://10.254.1.1:8460 --rate 1 --probes 100 --clients fast=1 --clients relax=2
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from turbonode.tiers import TIER_NAMES, tos_byte

PATH = "/v1/images/generations"
BACKOFF_S = 0.2  # a refused background request waits this long, or its Retry-After, before the next


@dataclass
class Probe:
    tier: str
    kind: str  # "probe" (open-loop turbo) or "background"
    sent_at: float  # seconds since the start of the load
    status: int  # HTTP status; 0 when no answer came
    latency_s: float  # send to last byte
    connect_s: float | None = None
    first_byte_s: float | None = None
    queue_wait_s: float | None = None  # the worker's: submit -> first step
    elapsed_s: float | None = None  # the worker's: submit -> finished
    retry_after_s: float | None = None  # a refusal's Retry-After
    error: str = ""


class TierConnection(http.client.HTTPConnection):
    """HTTP connection whose socket has the tier's TOS before connecting and keeps TCP_NODELAY."""

    def __init__(self, host: str, port: int, tos: int, timeout: float, nodelay: bool = True):
        super().__init__(host, port, timeout=timeout)
        self.tos, self.nodelay = tos, nodelay

    def connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.tos)
            if self.nodelay:  # http.client sends headers and body in two writes: no Nagle wait between
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
            sock.connect((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def send(url: str, tier: str, kind: str, t0: float, size: int, timeout: float, nodelay: bool) -> Probe:
    parts = urlsplit(url)
    body = json.dumps(
        {
            "prompt": f"a {tier} tier test image",
            "n": 1,
            "size": f"{size}x{size}",
            "response_format": "b64_json",
            "tier": tier,
        }
    )
    conn = TierConnection(parts.hostname or "", parts.port or 80, tos_byte(tier), timeout, nodelay)
    start = time.perf_counter()
    out = Probe(tier, kind, round(time.monotonic() - t0, 4), 0, 0.0)
    try:
        conn.connect()
        out.connect_s = time.perf_counter() - start
        conn.request("POST", PATH, body, {"Content-Type": "application/json", "X-Turbonode-Tier": tier})
        resp = conn.getresponse()
        out.first_byte_s = time.perf_counter() - start
        payload = resp.read()
        out.status = resp.status
        if resp.status == 200:
            info = json.loads(payload).get("turbonode", {})
            out.queue_wait_s, out.elapsed_s = info.get("queue_wait_s"), info.get("elapsed_s")
        else:
            out.error = payload[:200].decode(errors="replace")
            retry = resp.getheader("Retry-After")
            out.retry_after_s = float(retry) if retry and retry.isdigit() else None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.latency_s = time.perf_counter() - start
        conn.close()
    return out


def run(
    url: str,
    rate: float,
    probes: int,
    clients: dict[str, int],
    size: int,
    timeout: float,
    nodelay: bool = True,
    seed: int | None = None,
) -> list[Probe]:
    rng = random.Random(seed)
    t0 = time.monotonic()
    outcomes: list[Probe] = []
    lock = threading.Lock()
    done = threading.Event()

    def record(p: Probe) -> None:
        with lock:
            outcomes.append(p)

    def background(tier: str) -> None:
        while not done.is_set():
            p = send(url, tier, "background", t0, size, timeout, nodelay)
            if not done.is_set():  # a request cut short by the end of the run says nothing
                record(p)
            if p.status != 200:  # an honest client: honours Retry-After
                done.wait(max(BACKOFF_S, p.retry_after_s or 0.0))

    workers = [
        threading.Thread(target=background, args=(t,), daemon=True) for t, n in clients.items() for _ in range(n)
    ]
    for w in workers:
        w.start()
    arrivals = []
    due = time.monotonic()
    for _ in range(probes):
        due += rng.expovariate(rate)
        time.sleep(max(0.0, due - time.monotonic()))
        th = threading.Thread(
            target=lambda: record(send(url, "turbo", "probe", t0, size, timeout, nodelay)), daemon=True
        )
        th.start()
        arrivals.append(th)
    for th in arrivals:
        th.join(timeout + 5)
    done.set()
    for w in workers:
        w.join(timeout + 5)
    with lock:
        return sorted(outcomes, key=lambda p: p.sent_at)


def parse_clients(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        tier, _, n = v.partition("=")
        if tier not in TIER_NAMES or not n.isdigit():
            raise SystemExit(f"--clients: expected TIER=N with TIER one of {', '.join(TIER_NAMES)}, got {v!r}")
        out[tier] = out.get(tier, 0) + int(n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--rate", type=float, default=1.0, help="turbo arrivals per second (Poisson)")
    ap.add_argument("--probes", type=int, default=100, help="turbo requests to send")
    ap.add_argument("--clients", action="append", default=[], metavar="TIER=N", help="closed-loop background")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--no-nodelay", action="store_true", help="leave Nagle on (to measure what it costs)")
    ap.add_argument("--seed", type=int)
    args = ap.parse_args()
    if args.rate <= 0 or args.probes < 1:
        raise SystemExit("--rate must be positive and --probes at least 1")
    outcomes = run(
        args.url,
        args.rate,
        args.probes,
        parse_clients(args.clients),
        args.size,
        args.timeout,
        not args.no_nodelay,
        args.seed,
    )
    json.dump([asdict(p) for p in outcomes], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
