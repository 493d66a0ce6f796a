"""One agent for several workers (issue 22), as a subprocess (`turboctl agent run`) against real
workers: a worker that is killed, one still loading its model, one whose socket does not exist
yet and one that accepts and never answers are each that worker's own failed state; the others
are throttled, renewed and released on time, and each throttle lapses at its worker when the
agent dies. CPU load comes from a procfs the test drives (tests/helpers.FakeProc), so
the node-wide rule fires on a shared machine when the test says so."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.node import free_port, wait_for
from render.front.control_server import ControlServer
from render.front.daemon import loading_handlers
from tests.agent.helpers import stop_agent
from tests.helpers import ROOT, FakeProc, MiniWorker
from turbonode.jsonrpc import ControlClient

PERIOD = 0.1  # agent.sample_period
TTL = 1.0  # agent.throttle_ttl
POLICY = (
    "[policy]\nexit_s = 1.0\nmin_change_interval = 0.5\n"
    'disabled = ["netrx_cpu_share", "netrx_latency_p99_s", "gc_pause_s", "turbo_wait_s"]\n'
)


def agent_config(tmp_path: Path, procfs: Path, workers: dict[str, str], extra: str = "") -> Path:
    """An agent's configuration naming `workers` (name -> control socket)."""
    cfg = tmp_path / "node.toml"
    tables = "".join(
        f'[workers.{name}]\ncontrol_socket = "{path}"\nlisten = "127.0.0.1:{free_port()}"\n'
        for name, path in workers.items()
    )
    cfg.write_text(
        f'[worker]\nmodel = "tiny"\ndevice = "cpu"\nsize = 64\nmax_batch = 2\n'
        f'[agent]\nsocket = "{tmp_path}/agent.sock"\nmetrics = "127.0.0.1:0"\nprocfs = "{procfs}"\n'
        f"sample_period = {PERIOD}\nthrottle_ttl = {TTL}\n{POLICY}{extra}{tables}"
    )
    return cfg


def spawn(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    with open(tmp_path / f"{name}.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turboctl", *args],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log_path = tmp_path / f"{name}.log"  # type: ignore[attr-defined]
    return proc


def answer(path: str, method: str = "status"):
    try:
        return ControlClient(path, timeout=1.0).call(method)
    except Exception:  # noqa: BLE001 - not up (yet), or gone
        return None


def worker_throttle(path: str) -> dict | None:
    return (answer(path) or {}).get("throttle")


def set_at(throttle: dict) -> float:
    """When the worker took the throttle in force (wall clock)."""
    return throttle["expires_at"] - throttle["ttl_s"]


class Wedged:
    """A control socket that accepts connections and never answers (a worker hung in a call)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(16)
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)  # never read, never answered

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def node_escalated(agent_socket: str, after: float) -> dict | None:
    """The node's latest level change in the agent's status, if it came after `after` (wall clock)."""
    change = (answer(agent_socket) or {}).get("last_change")
    return change if change and change["at"] > after else None


@pytest.fixture
def fake_proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    fake = FakeProc(root)
    yield fake
    fake.close()


@pytest.mark.slow
def test_dead_loading_and_absent_workers_never_hold_the_others(tmp_path, fake_proc):
    sockets = {name: str(tmp_path / f"{name}.sock") for name in ("live", "killed", "loading", "late")}
    cfg = agent_config(tmp_path, fake_proc.root, sockets)
    procs = []
    loading = late = None
    try:
        for name in ("live", "killed"):  # real tiny workers, each its instance of the node's file
            procs.append(spawn(tmp_path, name, "worker", "run", "--config", str(cfg), "--instance", name))
        # what a worker answers while its model loads (render/front/daemon.py's own handlers), held there
        loading = ControlServer(sockets["loading"], loading_handlers()).start()
        for name, proc in zip(("live", "killed"), procs):
            assert wait_for(lambda p=sockets[name]: answer(p, "ping"), 180, 0.2), proc.log_path.read_text()[-2000:]
        assert answer(sockets["live"], "ping")["name"] == "live"  # its instance name, from the file
        agent = spawn(tmp_path, "agent", "-v", "agent", "run", "--config", str(cfg))
        procs.append(agent)
        rpc = ControlClient(f"{tmp_path}/agent.sock", timeout=1.0, peer="agent")

        def seen() -> dict:
            st = answer(rpc.path) if agent.poll() is None else None
            return (st or {}).get("workers", {})

        states = lambda: {n: w.get("state") for n, w in seen().items()}
        want = {"live": "ok", "killed": "ok", "loading": "loading", "late": "absent"}
        assert wait_for(lambda: states() == want, 20), (states(), agent.log_path.read_text()[-3000:])

        os.killpg(procs[1].pid, signal.SIGKILL)  # the killed worker (its engine dies with its front)
        procs[1].wait(10)
        assert wait_for(lambda: states()["killed"] == "absent", 5), states()

        fake_proc.busy = 0.9  # node-wide CPU load: every worker is to be throttled
        thr = wait_for(lambda: worker_throttle(sockets["live"]), 5)
        assert thr and "cpu_load=0.9 > 0.35" in thr["reason"], agent.log_path.read_text()[-3000:]
        decided = wait_for(lambda: seen()["live"]["last_change"], 2)["at"]
        assert set_at(thr) - decided <= 3 * PERIOD, (set_at(thr), decided)  # not held by its dead neighbours
        errors = lambda: {n: seen()[n]["throttle_error"] for n in ("killed", "loading", "late")}
        failures = wait_for(lambda: (e := errors()) and all(e.values()) and e, 2) or errors()
        assert "refused the connection" in failures["killed"] or "does not exist" in failures["killed"], failures
        assert "loading its model" in failures["loading"] and "does not exist" in failures["late"], failures

        late_worker = MiniWorker()  # the late worker comes up: its lane gets it throttled too
        late = late_worker.serve(sockets["late"])
        assert wait_for(lambda: late_worker.throttle_state, 3), seen()["late"]
        # renewed on time: the live worker's throttle never lapses while the load lasts
        renewals = []
        for _ in range(int(3 * TTL / PERIOD)):
            t = worker_throttle(sockets["live"])
            assert t is not None, "the live worker's throttle lapsed while the agent wanted it"
            renewals.append(set_at(t))
            time.sleep(PERIOD)
        gaps = [b - a for a, b in zip(sorted(set(renewals)), sorted(set(renewals))[1:])]
        assert gaps and max(gaps) <= TTL / 3 + 2 * PERIOD, gaps

        fake_proc.busy = 0.1  # recovery: released at each worker that answers
        assert wait_for(lambda: worker_throttle(sockets["live"]) is None, 10), seen()["live"]
        assert wait_for(lambda: late_worker.throttle_state is None, 3)

        fake_proc.busy = 0.9  # throttled again, then the agent dies: each lease lapses on its own
        assert wait_for(lambda: worker_throttle(sockets["live"]) and late_worker.throttle_state, 5)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        died = time.monotonic()
        assert wait_for(lambda: worker_throttle(sockets["live"]) is None, TTL + 1), "live's lease outlived the agent"
        assert wait_for(lambda: late_worker.status()["throttle"] is None, TTL + 1)
        assert time.monotonic() - died <= TTL + 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
        for server in (loading, late):
            if server is not None:
                server.close()


@pytest.mark.slow
def test_a_wedged_worker_never_delays_another_workers_throttle(tmp_path, fake_proc):
    sockets = {"wedged": str(tmp_path / "wedged.sock"), "ok": str(tmp_path / "ok.sock")}
    wedged = Wedged(sockets["wedged"])
    healthy = MiniWorker()
    server = healthy.serve(sockets["ok"])
    agent = spawn(
        tmp_path, "agent", "-v", "agent", "run", "--config", str(agent_config(tmp_path, fake_proc.root, sockets))
    )
    try:
        rpc = ControlClient(f"{tmp_path}/agent.sock", timeout=1.0, peer="agent")
        assert wait_for(lambda: (answer(rpc.path) or {}).get("workers", {}).get("ok", {}).get("state") == "ok", 20), (
            agent.log_path.read_text()[-3000:]
        )
        for _ in range(3):  # throttled and released three times, the wedged worker's calls pending throughout
            began = time.time()
            fake_proc.busy = 0.9
            assert wait_for(lambda: healthy.throttle_state, 5), agent.log_path.read_text()[-3000:]
            # from the node's decision (the CPU rule), before any worker's: the healthy worker's
            # throttle follows within a sample period, whatever the wedged worker's call does
            change = wait_for(lambda began=began: node_escalated(rpc.path, began), 2)
            assert change and change["to"] == "pressured", change
            assert healthy.throttled_at[-1] - change["at"] <= PERIOD, (healthy.throttled_at, change)
            time.sleep(3 * TTL / 3)  # renewed every third of the lease meanwhile
            renewals = [t for t in healthy.throttled_at if t > change["at"]]
            assert max(b - a for a, b in zip(renewals, renewals[1:])) <= TTL / 3 + PERIOD, renewals
            fake_proc.busy = 0.1
            assert wait_for(lambda: healthy.throttle_state is None, 10)
            assert wait_for(lambda: (answer(rpc.path) or {})["level"] == "normal", 5)
        st = answer(rpc.path)
        assert "timed out" in (st["workers"]["wedged"]["watchers"]["worker"]["error"] or "")
        assert st["workers"]["wedged"]["throttle_error"] and "timed out" in st["workers"]["wedged"]["throttle_error"]
    finally:
        rc, out = stop_agent(agent)
        server.close()
        wedged.close()
    assert rc == 0, out  # its stop is not held either: the wedged worker's release times out in its own lane
