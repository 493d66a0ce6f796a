"""`turboctl demo`: a sandbox node under mixed-tier load and a CPU fault, without and with turbonode.

Two network namespaces joined by veth (sandbox/netns.py) are the node and its client. The real
worker (tiny model) serves HTTP inside the node namespace, so its replies leave through the
node's shaped interface. Each phase runs the same load for the same time: closed-loop image
requests of every tier from the client namespace (sandbox.loadgen), bulk iperf3 flows from the
node to the client, and stress-ng on every CPU as the fault.

  without: the interface is a plain FIFO shaped to the same rate (HTB root, one class, pfifo),
           no agent;
  with:    the agent applies turbonode's QoS (eBPF classifier under the HTB tier tree), watches
           the node and throttles the worker's lower tiers while it is degraded.

Everything is bounded in time and torn down on exit, also on Ctrl-C: processes by PID, the
namespaces (and with them the qdiscs), the temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .netns import Sandbox
from turbonode.levels import LEVELS
from turbonode.errors import ControlError, TurbonodeError
from turbonode.jsonrpc import ControlClient
from turbonode.rates import parse_rate
from turbonode.tiers import TIER_NAMES

from .loadgen import Outcome, summarize

WORKER_PORT = 8460
NEEDS = ("ip", "tc", "iperf3", "stress-ng")


class DemoError(TurbonodeError):
    pass


@dataclass
class DemoSettings:
    rate: str = "20mbit"           # the node's link, shaped in both phases
    duration: float = 20.0         # seconds of load per phase
    size: int = 256                # image size in pixels: big enough that the link matters
    clients: dict = field(default_factory=lambda: {"turbo": 1, "fast": 1, "other": 1, "relax": 2})
    bulk_flows: int = 4
    stress: bool = True            # the fault: stress-ng on every CPU during the load


def preflight() -> None:
    """Refuse early, naming what is missing, rather than half-building a node."""
    if os.geteuid() != 0:
        raise DemoError("the demo needs root: it creates network namespaces, tc qdiscs and eBPF programs")
    missing = [n for n in NEEDS if shutil.which(n) is None]
    if missing:
        raise DemoError(f"missing programs: {', '.join(missing)} (run scripts/setup.sh)")


class DemoNode:
    """The sandbox, the worker and whatever a phase starts; `close` undoes all of it."""

    def __init__(self, settings: DemoSettings, log=print):
        self.s = settings
        self.log = log
        self.tmp = Path(tempfile.mkdtemp(prefix="turbonode-demo-"))
        self.sandbox = Sandbox(prefix="tnd")
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONUNBUFFERED": "1"}
        self.config = self.tmp / "turbonode.toml"

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> "DemoNode":
        sb = self.sandbox.create()
        self.config.write_text(
            f'[qos]\ndev = "{sb.dev}"\nnetns = "{sb.server}"\nrate = "{self.s.rate}"\nkeep_on_stop = false\n'
            f'[worker]\nlisten = "0.0.0.0:{WORKER_PORT}"\ncontrol_socket = "{self.tmp}/worker.sock"\n'
            f'model = "tiny"\ndevice = "cpu"\nsize = {self.s.size}\nmax_batch = 4\ndrain_timeout = 2.0\n'
            # fewer steps than the defaults: more requests per phase, so p99 means something
            'steps = { turbo = 2, fast = 4, other = 6, relax = 8 }\n'
            f'[agent]\nsocket = "{self.tmp}/agent.sock"\nworker_socket = "{self.tmp}/worker.sock"\n'
            f'metrics = "127.0.0.1:0"\nsample_period = 0.25\n')
        self.log(f"node: netns {sb.server} ({sb.server_ip}, {sb.dev} shaped to {self.s.rate}); "
                 f"client: netns {sb.client} ({sb.client_ip}); logs in {self.tmp}")
        self.worker = self._spawn("worker", sb.cmd(sb.server, *self._turboctl("worker", "run", "--config", str(self.config))))
        self.worker_rpc = ControlClient(f"{self.tmp}/worker.sock", timeout=2.0)
        self._wait(self.worker, lambda: self.worker_rpc.call("ping"), 180, "worker")
        self.log(f"worker: tiny model serving http://{sb.server_ip}:{WORKER_PORT}")
        return self

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs.clear()
        self.sandbox.delete()  # takes the veth pair and every qdisc on it along
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "DemoNode":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers ---------------------------------------------------------------------

    def _turboctl(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "turboctl", *args]

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.tmp / f"{name}.log", "a") as out:
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _wait(self, proc: subprocess.Popen, probe, timeout: float, name: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DemoError(f"the {name} exited ({proc.returncode}): see {self.tmp}/{name}.log\n"
                                + _tail(self.tmp / f"{name}.log"))
            try:
                probe()
                return
            except ControlError:
                time.sleep(0.2)
        raise DemoError(f"the {name} did not come up in {timeout:.0f} s: see {self.tmp}/{name}.log")

    def _release(self, proc: subprocess.Popen) -> None:
        _stop(proc)
        self.procs.remove(proc)

    # ---- the two setups ----------------------------------------------------------------

    def plain_fifo(self) -> None:
        """What the node has without turbonode: one FIFO shaped to the link rate."""
        sb, rate = self.sandbox, str(parse_rate(self.s.rate))
        for args in (("qdisc", "replace", "dev", sb.dev, "root", "handle", "1:", "htb", "default", "1"),
                     ("class", "add", "dev", sb.dev, "parent", "1:", "classid", "1:1", "htb",
                      "rate", f"{rate}bit", "quantum", "1514"),
                     ("qdisc", "add", "dev", sb.dev, "parent", "1:1", "pfifo", "limit", "1000")):
            sb.run(sb.server, "tc", *args)

    def remove_fifo(self) -> None:
        self.sandbox.run(self.sandbox.server, "tc", "qdisc", "del", "dev", self.sandbox.dev, "root")

    def start_agent(self) -> subprocess.Popen:
        agent = self._spawn("agent", self._turboctl("-v", "agent", "run", "--config", str(self.config)))
        self.agent_rpc = ControlClient(f"{self.tmp}/agent.sock", timeout=2.0, peer="agent")
        self._wait(agent, lambda: self.agent_rpc.call("status"), 120, "agent")
        return agent

    # ---- one phase -----------------------------------------------------------------------

    def run_load(self, watch_agent: bool) -> dict:
        """Bulk flows, the fault and the tiered requests, together, for `duration` seconds."""
        sb, d = self.sandbox, self.s.duration
        started = [self._spawn("iperf3-server", sb.cmd(sb.client, "iperf3", "-s", "-1"))]
        time.sleep(0.5)
        started.append(self._spawn("iperf3", sb.cmd(sb.server, "iperf3", "-c", sb.client_ip, "-P", str(self.s.bulk_flows),
                                                    "-t", str(int(d) + 3))))
        if self.s.stress:
            started.append(self._spawn("stress-ng", ["stress-ng", "--cpu", str(os.cpu_count() or 1),
                                                     "--timeout", f"{int(d) + 2}s", "--quiet"]))
        watcher = _AgentWatch(self.agent_rpc) if watch_agent else None
        try:
            argv = [sys.executable, "-m", "sandbox.loadgen", f"http://{sb.server_ip}:{WORKER_PORT}",
                    "--duration", str(d), "--size", str(self.s.size), "--timeout", "30"]
            for tier, n in self.s.clients.items():
                argv += ["--clients", f"{tier}={n}"]
            res = subprocess.run(sb.cmd(sb.client, *argv), env=self.env, capture_output=True, text=True,
                                 timeout=d + 60)
            if res.returncode != 0:
                raise DemoError(f"the load generator failed: {res.stderr.strip()[-2000:]}")
            outcomes = [Outcome(**o) for o in json.loads(res.stdout)]
        finally:
            if watcher:
                watcher.stop()
            for proc in started:
                self._release(proc)
        return {"tiers": summarize(outcomes), "agent": watcher.summary() if watcher else None}


class _AgentWatch:
    """Polls the agent's status during a phase: the highest level and the throttles it applied."""

    def __init__(self, rpc: ControlClient):
        self.rpc, self.levels, self.throttles, self.reasons = rpc, [], [], set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                st = self.rpc.call("status")
            except ControlError:
                continue
            self.levels.append(st.get("level_index", 0))
            self.reasons |= {r["signal"] for r in st.get("active", [])}
            applied = (st.get("actions") or {}).get("applied") or {}
            if applied.get("throttle"):
                self.throttles.append(applied["throttle"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self) -> dict:
        top = max(self.levels, default=0)
        return {"max_level": LEVELS[top], "reasons": sorted(self.reasons),
                "throttled_share": len(self.throttles) / len(self.levels) if self.levels else 0.0,
                "last_throttle": self.throttles[-1] if self.throttles else None}


def _stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM the process (its own session: ip netns exec and what it runs), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return ""


def run_demo(settings: DemoSettings, log=print) -> dict:
    """Both phases on one node; returns {"settings", "without", "with"}."""
    preflight()
    with DemoNode(settings, log) as node:
        log(f"phase 1/2: without turbonode (FIFO at {settings.rate}, no agent), {settings.duration:g} s of load "
            f"+ {settings.bulk_flows} bulk flows" + (" + stress-ng on every CPU" if settings.stress else ""))
        node.plain_fifo()
        without = node.run_load(watch_agent=False)
        node.remove_fifo()
        log("phase 2/2: with turbonode (eBPF classifier + HTB tiers, agent throttling the worker), same load")
        agent = node.start_agent()
        try:
            with_ = node.run_load(watch_agent=True)
        finally:
            node._release(agent)
    return {"settings": settings.__dict__, "without": without, "with": with_}


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def report(result: dict) -> str:
    """The per-tier comparison, side by side."""
    head = f"{'ok/sent':>8} {'refused':>7} {'p50 ms':>7} {'p99 ms':>7}"
    lines = [f"{'':6}  {'without turbonode':^31}  {'with turbonode':^31}", f"{'tier':6}  {head}  {head}"]
    a, b = result["without"]["tiers"], result["with"]["tiers"]
    empty = {"ok": 0, "requests": 0, "rejected": 0, "failed": 0, "p50_s": None, "p99_s": None}
    for tier in [t for t in TIER_NAMES if t in a or t in b]:
        cells = [f"{s['ok']:>3}/{s['requests']:<4} {s['rejected'] + s['failed']:>7} {_ms(s['p50_s']):>7} "
                 f"{_ms(s['p99_s']):>7}" for s in (a.get(tier, empty), b.get(tier, empty))]
        lines.append(f"{tier:6}  {cells[0]}  {cells[1]}")
    agent = result["with"].get("agent") or {}
    if agent:
        lines.append("")
        lines.append(f"agent: highest level {agent['max_level']}"
                     + (f" ({', '.join(agent['reasons'])})" if agent["reasons"] else "")
                     + f", worker throttled {agent['throttled_share']:.0%} of the time"
                     + (f", last throttle {agent['last_throttle']}" if agent["last_throttle"] else ""))
    lines.append("Latency: per image request, send to last byte, seen from the client namespace. "
                 "Refused: 429/503 answers (a shed or paused tier) and errors.")
    return "\n".join(lines)
