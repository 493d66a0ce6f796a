"""The shipped HAProxy configuration (deploy/haproxy/turbonode.cfg) in front of two nodes of two
real workers each (`[workers.a]`, `[workers.b]` of each node's file, on ports 8460 and 8461),
each node in its own network namespace, HAProxy in a third: turbo is spread over all four;
when one worker is not ready for turbo (its agent's lease says so, as at level critical) turbo
moves to the other three at once - while that worker, and the other worker of its node, keep
serving the other tiers - and comes back when the lease is released. Async jobs are polled
through the balancer on the worker that took them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox.fleet import wait_state
from sandbox.netns import Fleet
from tests.deploy.helpers import HAPROXY_CONFIG, haproxy_config
from tests.helpers import KERNEL_SKIP, daemon_env, start, stop, turboctl_argv

pytestmark = [
    pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or ""),
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (scripts/setup.sh)"),
]

PORT = 8460  # HAProxy's, and each node's first worker's (its second: 8461)
NODE_WORKERS = ("a", "b")

# Runs inside the balancer's namespace: N requests, one JSON line per answer.
CLIENT = r"""
import json, sys, urllib.request, urllib.error
url, tier, n, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
for _ in range(n):
    body = json.dumps({"prompt": "balanced", "tier": tier, "size": "64x64", "steps": 2, **extra}).encode()
    req = urllib.request.Request(url + "/v1/images/generations", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = {"status": r.status, "server": r.headers.get("X-Served-By"), "location": r.headers.get("Location")}
    except urllib.error.HTTPError as e:
        out = {"status": e.code, "server": e.headers.get("X-Served-By"), "error": e.read()[:200].decode(),
               "retry_after": e.headers.get("Retry-After")}
    print(json.dumps(out), flush=True)
"""
GET = r"""
import json, sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as r:
        print(json.dumps({"status": r.status, "server": r.headers.get("X-Served-By"), "body": json.loads(r.read())}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "server": e.headers.get("X-Served-By"), "body": e.read()[:300].decode()}))
"""


def client(fleet: Fleet, tier: str, n: int, url: str = f"http://127.0.0.1:{PORT}", **extra) -> list[dict]:
    """n generation requests from inside the balancer's namespace, through HAProxy (or to `url`)."""
    argv = [sys.executable, "-c", CLIENT, url, tier, str(n), json.dumps(extra)]
    out = fleet.run(fleet.balancer, *argv, timeout=300)
    return [json.loads(line) for line in out.stdout.splitlines()]


def get(fleet: Fleet, url: str) -> dict:
    return json.loads(fleet.run(fleet.balancer, sys.executable, "-c", GET, url).stdout)


def test_the_shipped_config_passes_haproxy_check_as_shipped():
    """Server names that do not resolve yet (gpu-node-01 ...) leave their servers down until they
    do (init-addr last,libc,none) instead of failing the whole configuration."""
    res = subprocess.run(["haproxy", "-c", "-f", str(HAPROXY_CONFIG)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "ALERT" not in res.stdout + res.stderr, res.stdout + res.stderr


@pytest.mark.slow
def test_turbo_moves_to_the_ready_workers():
    work = Path(tempfile.mkdtemp(prefix="tn-lb-"))
    procs = []
    try:
        with Fleet() as fleet:
            servers = []  # (name, address, port) in the shipped file's order
            for i, (ns, addr) in enumerate(zip(fleet.nodes, fleet.addresses), 1):
                node = f"n{i}"
                cfg = work / f"{node}.toml"  # each node's own file: its two workers
                cfg.write_text(
                    f'[node]\nname = "{node}"\n[worker]\nlisten = "{addr}:{PORT}"\n'
                    f'control_socket = "{work}/{node}.sock"\nmodel = "tiny"\ndevice = "cpu"\nsize = 64\n'
                    "refuse_unready = true\nintra_op_threads = 1\n" + "".join(f"[workers.{w}]\n" for w in NODE_WORKERS)
                )
                for j, w in enumerate(NODE_WORKERS):
                    procs.append(
                        start(
                            fleet.cmd(ns, *turboctl_argv("worker", "run", "--config", str(cfg), "--instance", w)),
                            daemon_env(HOME=str(work), XDG_CACHE_HOME=str(work / "cache")),
                        )
                    )
                    servers.append((f"{node}-{w}", addr, PORT + j))
            names = [name for name, _, _ in servers]
            stats = work / "haproxy.sock"
            # the shipped file's servers: each node's workers on 8460, 8461, as this fleet runs them
            shipped = re.findall(r"^\s+server \S+ \S+:(\d+) id", HAPROXY_CONFIG.read_text(), re.M)
            assert shipped == [str(port) for _, _, port in servers] * 2, shipped  # turbo, workers
            (work / "haproxy.cfg").write_text(haproxy_config(servers, stats))
            check = subprocess.run(["haproxy", "-c", "-f", str(work / "haproxy.cfg")], capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
            procs.append(
                start(fleet.cmd(fleet.balancer, "haproxy", "-db", "-f", str(work / "haproxy.cfg")), daemon_env())
            )
            for _proc, out in procs[:-1]:
                assert out.wait_for(r"serving http://", 300), out.text
            all_up = {(b, n): "UP" for b in ("turbo", "workers") for n in names}
            assert wait_state(stats, all_up, 20) == all_up

            # healthy fleet: turbo is spread over every worker of every node
            answers = client(fleet, "turbo", 12)
            assert {a["status"] for a in answers} == {200}, answers
            assert {a["server"] for a in answers} == set(names), answers

            # n1-a's lease (as its agent sends at level critical): not ready for turbo; n1-b is
            # its node's other worker, driven on its own
            sock_a = f"{work}/n1-a.sock"  # worker.control_socket with -<name> before .sock
            thr = subprocess.run(
                turboctl_argv(
                    "throttle",
                    "--socket",
                    sock_a,
                    "--unready",
                    "turbo",
                    "--reason",
                    "test: level critical",
                    "--ttl",
                    "120",
                ),
                env=daemon_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert thr.returncode == 0, thr.stderr
            a_url = f"http://{fleet.addresses[0]}:{PORT}"
            direct = get(fleet, f"{a_url}/readyz?tier=turbo")
            assert direct["status"] == 503 and "level critical" in json.dumps(direct["body"])
            assert get(fleet, f"http://{fleet.addresses[0]}:{PORT + 1}/readyz?tier=turbo")["status"] == 200
            # refuse_unready: new turbo work at n1-a itself gets a fast 503 with Retry-After ...
            [refused] = client(fleet, "turbo", 1, url=a_url)
            assert refused["status"] == 503 and "not ready" in refused["error"] and refused["retry_after"], refused
            # ... so through HAProxy turbo moves at once: a request that reaches n1-a before the health
            # check marks it down is retried elsewhere (retry-on 503), after that the check keeps it off
            answers = client(fleet, "turbo", 9)
            assert [a["status"] for a in answers] == [200] * 9, answers
            assert {a["server"] for a in answers} == set(names) - {"n1-a"}, answers
            states = wait_state(stats, {("turbo", "n1-a"): "DOWN"}, 10)
            assert states[("turbo", "n1-a")].startswith("DOWN") and states[("workers", "n1-a")] == "UP", states
            assert states[("turbo", "n1-b")] == "UP", states  # its neighbour on the same node stays in
            assert {a["server"] for a in client(fleet, "fast", 12)} == set(names)  # n1-a still serves the rest

            # async jobs, taken by any worker: polled through the balancer on the one that has them
            jobs = client(fleet, "relax", 8, **{"async": True})
            assert {j["status"] for j in jobs} == {202} and len({j["server"] for j in jobs}) > 1, jobs
            for job in jobs:
                polled = get(fleet, f"http://127.0.0.1:{PORT}{job['location']}")
                assert polled["status"] == 200 and polled["server"] == job["server"], (job, polled)

            # released: turbo comes back to n1-a
            rel = subprocess.run(
                turboctl_argv("release", "--socket", sock_a),
                env=daemon_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert rel.returncode == 0, rel.stderr
            assert wait_state(stats, all_up, 10) == all_up
            assert {a["server"] for a in client(fleet, "turbo", 12)} == set(names)
    finally:
        for proc, _ in reversed(procs):
            stop(proc, 60)
        shutil.rmtree(work, ignore_errors=True)
