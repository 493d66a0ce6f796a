"""Accounts benchmark: what API keys and a Redis ledger cost, how exact the ledger is, and a key
running out of turbo budget on a loaded node (docs/benchmarks.md, "Accounts").

    .venv/bin/python bench/accounts.py [--parts latency,fleet,slo]
        [--requests 1000] [--probes 300] [--rate 2] [--json FILE]

Real parts throughout: `turboctl worker run` (tiny model, each with its engine process), Debian's
redis-server on loopback (append-only), the sandbox node of bench/node_slo.py for the SLO part.

  latency  an open worker (no keys) and a keyed worker (keys file of 1000 keys, Redis ledger) on
           loopback; the same small turbo request (64 px, 1 step) to each in turn, --requests
           each over a kept-alive connection: end-to-end p50/p99 side by side and the difference
           (target: <= 1 ms added at p99). Beside it, in one process against the same Redis,
           the accounting path alone as a request runs it (key check, tier, budget read:
           one MGET) and a ledger write (one Lua script), p50/p99 over 5000 calls each.
           Then the ledger's accuracy: what Redis holds for the key against the engine seconds
           the answers reported (exact), and against the engine's own measured call time
           (turbonode_worker_step/decode_duration_seconds sums; target: within 1 %).
  fleet    two keyed workers on the one Redis, four clients (two per worker) with the same key
           at once: Redis's total against the sum the answers reported (lost updates: none).
  slo      the sandbox node (netns, HTB, the agent; bench/node_slo.py's node, no fault, the
           embedded ledger): closed-loop fast and relax clients, open-loop turbo probes (--probes
           at --rate per second, Poisson) alternating two keys, `spender` and `steady`; two
           cells: `reference` (spender unlimited) and `exhaust` (spender's turbo budget runs out
           about a third of the way in). Targets: every spender turbo request after its budget
           ran out is served as relax and says so (X-Turbonode-Downgraded: budget); steady's
           turbo p99 in `exhaust` <= 1.1 x its p99 in `reference`.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from render.accounts import Accounts  # noqa: E402
from render.accounts.keys import KeyRing  # noqa: E402
from render.accounts.ledger import Ledger, counter  # noqa: E402
from render.accounts.ledger_stores import RedisStore, SqliteStore  # noqa: E402
from render.accounts.trust import TrustedProxies  # noqa: E402
from sandbox.node import DemoNode  # noqa: E402
from sandbox.redis_server import RedisServer, free_port  # noqa: E402
from sandbox.settings import DemoSettings  # noqa: E402
from turbonode.accounts import entry, hash_key, parse_period  # noqa: E402
from turbonode.stats import percentile  # noqa: E402
from turbonode.tier_headers import BUDGET  # noqa: E402
from turbonode.tiers import TIER_NAMES  # noqa: E402

PARTS = ("latency", "fleet", "slo")
ADDED_P99_TARGET_S = 0.001
ACCURACY_TARGET = 0.01
SLO_TARGET_RATIO = 1.1
KEYS_IN_FILE = 1000  # a keys file of a realistic size: lookups are by hash, its size should not matter
BENCH_KEY = "tn-bench-key-0"
MICRO_CALLS = 5000
BACKGROUND = {"fast": 1, "relax": 2}  # the SLO part's closed-loop clients, as bench/node_slo.py's
EXHAUST_AT = 1 / 3  # the spender's budget: about this share of its probes


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def write_keys(path: Path, n: int = KEYS_IN_FILE, extra: str = "") -> None:
    path.write_text(
        "".join(entry(f"k{i}", hash_key(f"tn-bench-key-{i}"), list(TIER_NAMES), {"turbo": 1e6}, None) for i in range(n))
        + extra
    )


# ---- workers on loopback -----------------------------------------------------------------------


class Worker:
    """`turboctl worker run` on a loopback port, its log in the run's directory."""

    def __init__(self, tmp: Path, name: str, worker_toml: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / f"{name}.toml"
        cfg.write_text(
            f'[node]\nname = "{name}"\n[worker]\nlisten = "127.0.0.1:{self.port}"\n'
            f'control_socket = "{tmp}/{name}.sock"\nmodel = "tiny"\ndevice = "cpu"\nsize = 64\n'
            f"steps = {{ turbo = 1, fast = 2 }}\n{worker_toml}"
        )
        self.log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turboctl", "worker", "run", "--config", str(cfg)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}); see {self.log.name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"worker not ready in {timeout:.0f} s; see {self.log.name}")

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value, every sample (label order as exported)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "node")
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class Client:
    """One kept-alive HTTP connection to a worker."""

    def __init__(self, url: str, key: str | None):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def render(self, tier: str = "turbo", steps: int = 1) -> tuple[float, int, dict]:
        body = json.dumps({"prompt": "a lighthouse", "size": "64x64", "steps": steps, "tier": tier})
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/images/generations", body, self.headers)
        resp = self.conn.getresponse()
        payload = resp.read()
        took = time.perf_counter() - t0
        return took, resp.status, json.loads(payload).get("turbonode", {}) if resp.status == 200 else {}


def wait_written(workers: list[Worker], timeout: float = 30) -> None:
    """Until every worker's ledger has written what it was charged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(w.metrics().get("turbonode_worker_ledger_unwritten_seconds{}", 1) == 0 for w in workers):
            return
        time.sleep(0.2)
    raise RuntimeError("the ledger did not write every charge")


def redis_total(url: str, name: str, tier: str) -> int:
    async def read() -> int:
        store = RedisStore(url)
        try:
            return (await store.read([counter(name, tier, parse_period("month").window(time.time()).id)]))[0]
        finally:
            await store.close()

    return asyncio.run(read())


# ---- part: latency and accuracy --------------------------------------------------------------


def accounting_path(redis_url: str, keys: Path) -> dict:
    """The accounting a request runs, alone, in one process against the same Redis."""

    async def run() -> dict:
        accounts = Accounts(
            KeyRing(str(keys), parse_period("month")), Ledger(RedisStore(redis_url)), TrustedProxies([])
        )
        headers = {"Authorization": f"Bearer {BENCH_KEY}"}
        admit, write = [], []
        try:
            for _ in range(MICRO_CALLS):
                t0 = time.perf_counter()
                account = accounts.identify(headers, "127.0.0.1")
                asked = accounts.asked("turbo", headers, "127.0.0.1")
                await accounts.admit(account, asked, None)
                admit.append(time.perf_counter() - t0)
                accounts.charge(account, "turbo", 0.0123)
                t0 = time.perf_counter()
                assert accounts.ledger is not None and await accounts.ledger.write_once()
                write.append(time.perf_counter() - t0)
        finally:
            await accounts.close()
        return {
            "n": MICRO_CALLS,
            "admit_p50_s": percentile(admit, 50),
            "admit_p99_s": percentile(admit, 99),
            "write_p50_s": percentile(write, 50),
            "write_p99_s": percentile(write, 99),
        }

    return asyncio.run(run())


def part_latency(tmp: Path, redis: RedisServer, n: int, result: dict) -> Worker:
    keys = tmp / "keys.toml"
    write_keys(keys)
    open_w = Worker(tmp, "open", "")
    keyed = Worker(tmp, "keyed", f'keys_file = "{keys}"\nledger = "{redis.url}"\n')
    try:
        for w in (open_w, keyed):
            w.wait_ready()
        clients = {"open": Client(open_w.url, None), "keyed": Client(keyed.url, BENCH_KEY)}
        for c in clients.values():  # warm: graphs, caches, connections
            for _ in range(20):
                c.render()
        times: dict[str, list[float]] = {"open": [], "keyed": []}
        reported: list[float] = []
        before = keyed.metrics()
        charged_before = redis_total(redis.url, "k0", "turbo")
        for i in range(n):
            for name in ("open", "keyed") if i % 2 else ("keyed", "open"):
                took, status, meta = clients[name].render()
                if status != 200:
                    raise RuntimeError(f"{name}: status {status}")
                times[name].append(took)
                if name == "keyed":
                    reported.append(meta["engine_s"])
        wait_written([keyed])
        after = keyed.metrics()
        charged = redis_total(redis.url, "k0", "turbo") - charged_before
        busy = sum(
            after[f"turbonode_worker_{m}_duration_seconds_sum{{}}"]
            - before[f"turbonode_worker_{m}_duration_seconds_sum{{}}"]
            for m in ("step", "decode")
        )
        lat = {name: {"n": len(v), "p50_s": percentile(v, 50), "p99_s": percentile(v, 99)} for name, v in times.items()}
        lat["added_p50_s"] = lat["keyed"]["p50_s"] - lat["open"]["p50_s"]
        lat["added_p99_s"] = lat["keyed"]["p99_s"] - lat["open"]["p99_s"]
        result["latency"] = lat
        result["accounting_path"] = accounting_path(redis.url, keys)
        reported_us = sum(round(u * 1e6) for u in reported)
        result["accuracy"] = {
            "jobs": len(reported),
            "charged_us": charged,
            "reported_us": reported_us,
            "engine_busy_s": busy,
            "charged_vs_reported": charged / reported_us - 1 if reported_us else None,
            "charged_vs_engine": charged / 1e6 / busy - 1 if busy else None,
        }
    finally:
        open_w.stop()
    return keyed


# ---- part: two workers, one key ----------------------------------------------------------------


def part_fleet(tmp: Path, redis: RedisServer, keyed: Worker, n: int, result: dict) -> None:
    keys = tmp / "keys.toml"
    other = Worker(tmp, "keyed2", f'keys_file = "{keys}"\nledger = "{redis.url}"\n')
    try:
        other.wait_ready()
        before = redis_total(redis.url, "k0", "fast")
        reported: list[float] = []
        lock = threading.Lock()

        def run(url: str) -> None:
            c = Client(url, BENCH_KEY)
            for _ in range(n):
                _, status, meta = c.render("fast")
                if status == 200:
                    with lock:
                        reported.append(meta["engine_s"])

        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=(w.url,)) for w in (keyed, other, keyed, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_written([keyed, other])
        charged = redis_total(redis.url, "k0", "fast") - before
        reported_us = sum(round(u * 1e6) for u in reported)
        result["fleet"] = {
            "workers": 2,
            "clients": len(threads),
            "requests": len(reported),
            "seconds": time.monotonic() - t0,
            "charged_us": charged,
            "reported_us": reported_us,
            "lost_us": reported_us - charged,
        }
    finally:
        other.stop()


# ---- part: a key exhausting its turbo budget on the sandbox node -----------------------------


def slo_cell(node: DemoNode, keys: Path, spender_budget: float | None, probes: int, rate: float, cell: str) -> dict:
    spender, steady = f"spender-{cell}", f"steady-{cell}"
    budget = {"turbo": spender_budget} if spender_budget is not None else {}
    text = "".join(
        entry(name, hash_key(f"tn-{name}"), ["turbo", "relax"] if name == spender else list(TIER_NAMES), b, None)
        for name, b in ((spender, budget), (steady, {}), (f"background-{cell}", {}))
    )
    keys.write_text(text)
    time.sleep(1.5)  # the worker looks at the file once a second
    outcomes, wall = node.load(
        BACKGROUND,
        probes,
        rate,
        key=(f"background-{cell}", f"tn-background-{cell}"),
        probe_keys=[(spender, f"tn-{spender}"), (steady, f"tn-{steady}")],
    )
    probes_out = [o for o in outcomes if o.kind == "probe"]

    def turbo(name: str) -> list:
        return [o for o in probes_out if o.account == name and o.status == 200]

    steady_lat = [o.latency for o in turbo(steady)]
    spent = turbo(spender)
    first_down = next((i for i, o in enumerate(spent) if o.served_tier != "turbo"), None)
    after = spent[first_down:] if first_down is not None else []
    return {
        "steady": {"n": len(steady_lat), "p50_s": percentile(steady_lat, 50), "p99_s": percentile(steady_lat, 99)},
        "spender": {
            "answered": len(spent),
            "refused_or_failed": sum(o.status != 200 for o in probes_out if o.account == spender),
            "served_turbo": sum(o.served_tier == "turbo" for o in spent),
            "served_relax_budget": sum(o.served_tier == "relax" and o.downgraded == BUDGET for o in spent),
            "after_first_downgrade_all_said_so": bool(after)
            and all(o.served_tier == "relax" and o.downgraded == BUDGET for o in after),
            "turbo_p99_s": percentile([o.latency for o in spent if o.served_tier == "turbo"], 99),
            "relax_p50_s": percentile([o.latency for o in spent if o.served_tier == "relax"], 50),
        },
        "wall_s": wall,
    }


def part_slo(tmp: Path, probes: int, rate: float, result: dict) -> None:
    keys = tmp / "node-keys.toml"
    keys.write_text("")
    worker = {"keys_file": str(keys), "ledger_file": str(tmp / "node-ledger.sqlite3")}
    node = DemoNode(DemoSettings(worker_config=worker), log)
    with node:
        agent = node.start_agent()
        try:
            log(f"slo: reference cell, {probes} probes at {rate:g}/s")
            ref = slo_cell(node, keys, None, probes, rate, "reference")
            per_job = turbo_engine_s_per_job(tmp / "node-ledger.sqlite3", "spender-reference", ref)
            budget = per_job * probes / 2 * EXHAUST_AT
            log(f"slo: exhaust cell, spender's turbo budget {budget:.3f} engine s (~{per_job * 1000:.1f} ms a job)")
            exhaust = slo_cell(node, keys, budget, probes, rate, "exhaust")
        finally:
            node.release(agent)
    ratio = (
        exhaust["steady"]["p99_s"] / ref["steady"]["p99_s"]
        if exhaust["steady"]["p99_s"] and ref["steady"]["p99_s"]
        else None
    )
    result["slo"] = {"probes": probes, "rate": rate, "reference": ref, "exhaust": exhaust, "steady_p99_ratio": ratio}


def turbo_engine_s_per_job(ledger_file: Path, name: str, cell: dict) -> float:
    """What a turbo job of `name` cost in the cell: its turbo counter in the node's (embedded)
    ledger over its turbo answers."""

    async def read() -> int:
        store = SqliteStore(str(ledger_file), time.time)
        try:
            return (await store.read([counter(name, "turbo", parse_period("month").window(time.time()).id)]))[0]
        finally:
            await store.close()

    return asyncio.run(read()) / 1e6 / max(1, cell["spender"]["served_turbo"])


# ---- report --------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: dict) -> str:
    lines = []
    if "latency" in r:
        lat, path, acc = r["latency"], r["accounting_path"], r["accuracy"]
        added_ok = lat["added_p99_s"] <= ADDED_P99_TARGET_S
        lines += [
            "latency: the same turbo request (64 px, 1 step) to an open worker and a keyed one (Redis on loopback)",
            f"  {'':<8} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}",
        ]
        for w in ("open", "keyed"):
            lines.append(f"  {w:<8} {lat[w]['n']:>5} {ms(lat[w]['p50_s']):>8} {ms(lat[w]['p99_s']):>8}")
        lines += [
            f"  added    {'':>5} {ms(lat['added_p50_s']):>8} {ms(lat['added_p99_s']):>8}   "
            f"target <= {ms(ADDED_P99_TARGET_S)} ms at p99: {verdict(added_ok)}",
            f"  the accounting path alone (n={path['n']}): key, tier, budget read p50/p99 "
            f"{ms(path['admit_p50_s'])}/{ms(path['admit_p99_s'])} ms; a ledger write "
            f"{ms(path['write_p50_s'])}/{ms(path['write_p99_s'])} ms (off the request's path)",
            f"accuracy ({acc['jobs']} jobs): Redis holds {acc['charged_us'] / 1e6:.6f} s; the answers reported "
            f"{acc['reported_us'] / 1e6:.6f} s ({acc['charged_vs_reported']:+.4%}); the engine measured "
            f"{acc['engine_busy_s']:.6f} s of calls ({acc['charged_vs_engine']:+.4%}; "
            f"target within {ACCURACY_TARGET:.0%}: {verdict(abs(acc['charged_vs_engine']) <= ACCURACY_TARGET)})",
        ]
    if "fleet" in r:
        f = r["fleet"]
        lines.append(
            f"fleet: {f['workers']} workers, {f['clients']} clients, one key, {f['requests']} requests in "
            f"{f['seconds']:.0f} s: Redis {f['charged_us']} us, answers {f['reported_us']} us, lost {f['lost_us']} us"
        )
    if "slo" in r:
        s = r["slo"]
        ref, ex, ratio = s["reference"]["steady"], s["exhaust"]["steady"], s["steady_p99_ratio"]
        sp = s["exhaust"]["spender"]
        lines += [
            f"slo: sandbox node, agent on, no fault; {s['probes']} turbo probes per cell at {s['rate']:g}/s, "
            "alternating spender and steady",
            f"  steady turbo: reference n={ref['n']} p50/p99 {ms(ref['p50_s'])}/{ms(ref['p99_s'])} ms; "
            f"exhaust n={ex['n']} p50/p99 {ms(ex['p50_s'])}/{ms(ex['p99_s'])} ms; ratio "
            + (f"{ratio:.2f}" if ratio else "-"),
            f"  target steady p99 ratio <= {SLO_TARGET_RATIO}: {verdict(bool(ratio) and ratio <= SLO_TARGET_RATIO)}",
            f"  spender in exhaust: {sp['answered']} answered ({sp['refused_or_failed']} refused or failed), "
            f"{sp['served_turbo']} as turbo, then {sp['served_relax_budget']} as relax saying 'budget'; "
            f"every one after the first downgrade said so: {sp['after_first_downgrade_all_said_so']}",
        ]
    return "\n".join(lines)


def verdicts(r: dict) -> list[dict]:
    """One per target of the parts that ran."""
    out: list[dict] = []
    if "latency" in r:
        added, off = r["latency"]["added_p99_s"], r["accuracy"]["charged_vs_engine"]
        out.append({"target": f"<= {ms(ADDED_P99_TARGET_S)} ms added at p99", "value": f"{ms(added)} ms"})
        out[-1]["met"] = added <= ADDED_P99_TARGET_S
        out.append({"target": f"ledger within {ACCURACY_TARGET:.0%} of the engine", "value": f"{off:+.5%}"})
        out[-1]["met"] = abs(off) <= ACCURACY_TARGET
    if "fleet" in r:
        lost = r["fleet"]["lost_us"]
        out.append({"target": "no update lost between workers", "value": f"{lost} us lost", "met": lost == 0})
    if "slo" in r:
        ratio, said = r["slo"]["steady_p99_ratio"], r["slo"]["exhaust"]["spender"]["after_first_downgrade_all_said_so"]
        out.append(
            {
                "target": f"the other keys' turbo p99 <= {SLO_TARGET_RATIO}x",
                "value": "-" if ratio is None else f"{ratio:.2f}x",
            }
        )
        out[-1]["met"] = bool(ratio) and ratio <= SLO_TARGET_RATIO
        out.append(
            {
                "target": "a key out of budget: its turbo runs as relax and says so",
                "value": str(said),
                "met": bool(said),
            }
        )
    return out


def main() -> int:
    from bench.record import flat, judged, record, variant_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    ap.add_argument("--requests", type=int, default=1000, help="latency part: requests to each worker")
    ap.add_argument("--fleet-requests", type=int, default=100, help="fleet part: requests per client")
    ap.add_argument("--probes", type=int, default=300, help="slo part: turbo probes per cell (both keys)")
    ap.add_argument("--rate", type=float, default=2.0, help="slo part: probes per second (Poisson)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if any(p not in PARTS for p in parts):
        ap.error(f"unknown part in {args.parts}")
    for sig in (signal.SIGTERM, signal.SIGINT):  # unwind: workers, Redis and the sandbox are removed
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    result: dict = {"parts": parts, "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    tmp = Path(tempfile.mkdtemp(prefix="tn-bench-accounts-"))
    try:
        if "latency" in parts or "fleet" in parts:
            with RedisServer() as redis:
                keyed = part_latency(tmp, redis, args.requests, result) if "latency" in parts else None
                try:
                    if "fleet" in parts:
                        if keyed is None:
                            write_keys(tmp / "keys.toml")
                            keyed = Worker(tmp, "keyed", f'keys_file = "{tmp / "keys.toml"}"\nledger = "{redis.url}"\n')
                            keyed.wait_ready()
                        part_fleet(tmp, redis, keyed, args.fleet_requests, result)
                finally:
                    if keyed is not None:
                        keyed.stop()
        if "slo" in parts:
            part_slo(tmp, args.probes, args.rate, result)
    finally:
        result["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(result))
    found = verdicts(result)
    record(
        "accounts",
        variant=variant_of(ap, args),
        n=args.requests if "latency" in parts else None,
        n_per="requests to each worker (latency part)" if "latency" in parts else None,
        headline="; ".join(f"{v['target']}: {v['value']}" for v in found),
        figures=flat(result, skip=("parts", "started_utc", "finished_utc")),
        **judged(found),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
