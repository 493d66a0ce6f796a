"""Tiered image-request load against a worker's HTTP API, for the demo and benchmarks.

Closed-loop clients (`--clients TIER=N`): each sends one request, waits for the answer, sends
the next; a refused one (429/503) waits for its Retry-After, as an honest client does. With
`--probes N`, N requests of one tier (turbo) also arrive open-loop (Poisson, `--rate` per
second): each at its own time whatever the others are doing, so a slow node cannot slow the
arrivals down and hide its tail; the closed-loop clients then run until the last probe is
answered, else for `--duration`. Each request names its tier (body and X-Turbonode-Tier
header), and its socket carries the tier's DSCP before it connects (the SYN too) and keeps
TCP_NODELAY, like a real client's. Per request: connect, first byte, last byte, and the
worker's own queue wait and submit-to-finish time from its answer. `--cpus` keeps the client on
the CPUs of the worker it loads (a sandbox node with pinned workers). The demo and
bench/node_slo.py run it inside the client network namespace (`python -m sandbox.loadgen URL
--clients fast=1 --probes 100 ...`), which prints the outcomes as JSON.
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

from turbonode.affinity import pin_cpus
from turbonode.cgroups import parse_cpu_list
from turbonode.stats import percentile
from turbonode.tier_headers import DOWNGRADED_HEADER, TIER_HEADER
from turbonode.tiers import PROTECTED_TIER, TIER_NAMES, tos_byte

PATH = "/v1/images/generations"
SERVED_BY = "X-Served-By"  # deploy/haproxy/turbonode.cfg names the server that answered
BACKOFF_S = 0.2  # a refused request waits this long, or its Retry-After if longer, before the next


@dataclass
class Outcome:
    tier: str
    status: int  # HTTP status; 0 when no answer came (connection error, timeout)
    latency: float  # seconds from sending the request to the end of the answer
    error: str = ""
    kind: str = "closed"  # "closed" (a closed-loop client's) or "probe" (open-loop)
    sent_at: float = 0.0  # seconds since the load started
    connect_s: float | None = None  # TCP handshake, as the client saw it
    first_byte_s: float | None = None
    queue_wait_s: float | None = None  # the worker's: submit -> first step
    elapsed_s: float | None = None  # the worker's: submit -> finished
    answer_s: float | None = None  # the worker's: finished -> its answer made (where its engine wrote it)
    retry_after_s: float | None = None  # a refusal's Retry-After
    account: str = ""  # the name of the API key it was sent with ('' without one)
    served_tier: str | None = None  # what the answer says served it (X-Turbonode-Tier) ...
    downgraded: str | None = None  # ... and why that is not `tier` (X-Turbonode-Downgraded)
    server: str = ""  # who answered, behind a balancer (its X-Served-By header)


class TierConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket carries a TOS byte from its SYN on, and TCP_NODELAY:
    http.client sends the headers and the body in two writes, and Nagle would hold the body
    until the first is acknowledged (a delayed ACK)."""

    def __init__(self, host: str, port: int, tos: int, timeout: float, nodelay: bool = True):
        super().__init__(host, port, timeout=timeout)
        self.tos, self.nodelay = tos, nodelay

    def connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.tos)
            if self.nodelay:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
            sock.connect((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def request_image(
    url: str,
    tier: str,
    size: int = 64,
    steps: int | None = None,
    timeout: float = 60,
    *,
    kind: str = "closed",
    started: float | None = None,
    nodelay: bool = True,
    key: tuple[str, str] | None = None,
) -> Outcome:
    """One request; `started` (monotonic) is when the load began, for Outcome.sent_at; `key`:
    (name, API key) to send it with."""
    parts = urlsplit(url)
    body: dict = {
        "prompt": f"a {tier} tier test image",
        "n": 1,
        "size": f"{size}x{size}",
        "response_format": "b64_json",
        "tier": tier,
    }
    if steps:
        body["steps"] = steps
    sent_at = 0.0 if started is None else round(time.monotonic() - started, 4)
    out = Outcome(tier, 0, 0.0, kind=kind, sent_at=sent_at, account=key[0] if key else "")
    headers = {"Content-Type": "application/json", TIER_HEADER: tier}
    if key:
        headers["Authorization"] = f"Bearer {key[1]}"
    conn = TierConnection(parts.hostname or "", parts.port or 80, tos_byte(tier), timeout, nodelay)
    start = time.perf_counter()
    try:
        conn.connect()
        out.connect_s = time.perf_counter() - start
        conn.request("POST", PATH, json.dumps(body), headers)
        resp = conn.getresponse()
        out.first_byte_s = time.perf_counter() - start
        payload = resp.read()
        out.status = resp.status
        out.served_tier, out.downgraded = resp.getheader(TIER_HEADER), resp.getheader(DOWNGRADED_HEADER)
        out.server = resp.getheader(SERVED_BY) or ""
        if resp.status == 200:
            info = json.loads(payload).get("turbonode") or {}
            out.queue_wait_s, out.elapsed_s = info.get("queue_wait_s"), info.get("elapsed_s")
            out.answer_s = info.get("answer_s")
        else:
            out.error = payload[:200].decode(errors="replace")
            retry = resp.getheader("Retry-After") or ""
            out.retry_after_s = float(retry) if retry.isdigit() else None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.latency = time.perf_counter() - start
        conn.close()
    return out


def run_load(
    url: str,
    clients: dict[str, int],
    duration: float = 10.0,
    size: int = 64,
    steps: dict[str, int] | None = None,
    timeout: float = 60,
    *,
    probes: int = 0,
    rate: float = 1.0,
    nodelay: bool = True,
    seed: int | None = None,
    key: tuple[str, str] | None = None,
    probe_keys: list[tuple[str, str]] | None = None,
    start_at: float | None = None,
) -> list[Outcome]:
    """`clients[tier]` closed-loop clients, plus `probes` open-loop turbo requests at `rate` per
    second; until the last probe is answered, or for `duration` seconds without probes. Every
    request carries `key` (name, API key), the probes `probe_keys` in turn where given. The load
    starts at `start_at` (CLOCK_MONOTONIC, the same in every process), else now."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.monotonic()))
    started = time.monotonic()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    done = threading.Event()
    steps = steps or {}

    def record(out: Outcome) -> None:
        with lock:
            outcomes.append(out)

    def client(tier: str) -> None:
        while not done.is_set():
            out = request_image(url, tier, size, steps.get(tier), timeout, started=started, nodelay=nodelay, key=key)
            if done.is_set() and probes:
                return  # cut short by the end of the probes: says nothing about the tier
            record(out)
            if out.status != 200:  # 429/503/errors: back off as told, instead of spinning
                done.wait(max(BACKOFF_S, out.retry_after_s or 0.0))

    def probe(key: tuple[str, str] | None) -> None:
        record(
            request_image(
                url,
                PROTECTED_TIER,
                size,
                steps.get(PROTECTED_TIER),
                timeout,
                kind="probe",
                started=started,
                nodelay=nodelay,
                key=key,
            )
        )

    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t, n in clients.items() for _ in range(n)]
    for th in threads:
        th.start()
    if probes:
        rng, due, arrivals = random.Random(seed), started, []
        for i in range(probes):
            due += rng.expovariate(rate)
            time.sleep(max(0.0, due - time.monotonic()))
            probe_key = probe_keys[i % len(probe_keys)] if probe_keys else key
            arrivals.append(threading.Thread(target=probe, args=(probe_key,), daemon=True))
            arrivals[-1].start()
        for th in arrivals:
            th.join(timeout + 5)
    else:
        done.wait(duration)
    done.set()
    for th in threads:
        th.join(timeout + 5)
    with lock:
        return sorted(outcomes, key=lambda o: o.sent_at)


def summarize(outcomes: list[Outcome], wall_s: float | None = None) -> dict[str, dict]:
    """Per tier: requests, ok, rejected (429/503), failed, p50/p99/max latency of the ok ones,
    the handshake's p99 and, over `wall_s` seconds, images per second."""
    out = {}
    for tier in TIER_NAMES:
        mine = [o for o in outcomes if o.tier == tier]
        if not mine:
            continue
        ok = [o for o in mine if o.status == 200]
        latency = [o.latency for o in ok]
        rejected = sum(o.status in (429, 503) for o in mine)
        out[tier] = {
            "requests": len(mine),
            "ok": len(ok),
            "rejected": rejected,
            "failed": len(mine) - len(ok) - rejected,
            "p50_s": percentile(latency, 50),
            "p99_s": percentile(latency, 99),
            "max_s": max(latency, default=None),
            "connect_p99_s": percentile([o.connect_s for o in ok if o.connect_s is not None], 99),
            "images_per_s": len(ok) / wall_s if wall_s else None,
        }
    return out


def _tier_count(value: str) -> tuple[str, int]:
    tier, _, n = value.partition("=")
    if tier not in TIER_NAMES or not n.isdigit():
        raise argparse.ArgumentTypeError(f"expected TIER=N with TIER one of {', '.join(TIER_NAMES)}, got {value!r}")
    return tier, int(n)


def _named_key(value: str) -> tuple[str, str]:
    name, sep, key = value.partition("=")
    if not sep or not name or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY, got {value[:20]!r}...")
    return name, key


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


def _cpus(value: str) -> frozenset[int]:
    try:
        return parse_cpu_list(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """Send tiered image requests to URL (closed-loop clients, open-loop probes); print every
    outcome as JSON."""
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
    parser.add_argument("--probes", type=_at_least(0, int), default=0, help=f"open-loop {PROTECTED_TIER} requests")
    parser.add_argument("--rate", type=_at_least(0.01), default=1.0, help="probe arrivals per second (default 1)")
    parser.add_argument("--no-nodelay", action="store_true", help="leave Nagle on (to measure what it costs)")
    parser.add_argument("--seed", type=int, help="seed of the probes' arrival times")
    parser.add_argument("--key", type=_named_key, metavar="NAME=KEY", help="send every request with this API key")
    parser.add_argument(
        "--probe-key",
        type=_named_key,
        action="append",
        default=[],
        metavar="NAME=KEY",
        help="the probes' API keys, in turn (repeatable; default --key)",
    )
    parser.add_argument(
        "--start-at",
        type=float,
        help="start at this CLOCK_MONOTONIC time (s), so that another process can time its events by the load's",
    )
    parser.add_argument(
        "--cpus",
        type=_cpus,
        default=frozenset(),
        metavar="LIST",
        help="run on these CPUs only, e.g. 1 or 0-3 (default: any)",
    )
    args = parser.parse_args(argv)
    pin_cpus(args.cpus)
    outcomes = run_load(
        args.url,
        dict(args.clients),
        args.duration,
        args.size,
        timeout=args.timeout,
        probes=args.probes,
        rate=args.rate,
        nodelay=not args.no_nodelay,
        seed=args.seed,
        key=args.key,
        probe_keys=args.probe_key,
        start_at=args.start_at,
    )
    print(json.dumps([asdict(o) for o in outcomes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
