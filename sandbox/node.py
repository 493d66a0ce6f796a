"""The demo's sandbox node: two network namespaces (sandbox/netns.py), the real worker serving
HTTP inside the node namespace, and what a phase starts around it: the agent, bulk iperf3
flows, the stress-ng fault and the tiered image requests from the client namespace
(sandbox.loadgen). `close` stops every process it started by PID and deletes the namespaces
(and with them the qdiscs) and its temporary directory, also when a phase fails.
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
from pathlib import Path
from typing import TYPE_CHECKING

from turbonode.config import WorkerConfig, split_host_port
from turbonode.errors import ControlError, TurbonodeError
from turbonode.jsonrpc import ControlClient
from turbonode.levels import LEVELS
from turbonode.rates import parse_rate

from .loadgen import Outcome, summarize
from .netns import Sandbox

if TYPE_CHECKING:
    from .demo import DemoSettings

WORKER_PORT = split_host_port(WorkerConfig().listen)[1]


class DemoError(TurbonodeError):
    pass


class DemoNode:
    """The sandbox, the worker and whatever a phase starts; `close` undoes all of it."""

    def __init__(self, settings: DemoSettings, log=print):
        self.s = settings
        self.log = log
        self.sandbox = Sandbox(prefix="tnd")
        # named after the node's namespace, so a test can find it; removed on close unless keep_logs
        self.tmp = Path(tempfile.mkdtemp(prefix=f"turbonode-demo-{self.sandbox.server}-"))
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONUNBUFFERED": "1"}
        self.config = self.tmp / "turbonode.toml"

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> DemoNode:
        sb = self.sandbox.create()
        self.config.write_text(
            f'[qos]\ndev = "{sb.dev}"\nnetns = "{sb.server}"\nrate = "{self.s.rate}"\nkeep_on_stop = false\n'
            f'[worker]\nlisten = "0.0.0.0:{WORKER_PORT}"\ncontrol_socket = "{self.tmp}/worker.sock"\n'
            f'model = "tiny"\ndevice = "cpu"\nsize = {self.s.size}\nmax_batch = 4\ndrain_timeout = 2.0\n'
            # fewer steps than the defaults: more requests per phase, so p99 means something
            "steps = { turbo = 2, fast = 4, other = 6, relax = 8 }\n"
            f'[agent]\nsocket = "{self.tmp}/agent.sock"\nworker_socket = "{self.tmp}/worker.sock"\n'
            f'metrics = "127.0.0.1:0"\nsample_period = 0.25\n'
        )
        self.log(
            f"node: netns {sb.server} ({sb.server_ip}, {sb.dev} shaped to {self.s.rate}); "
            f"client: netns {sb.client} ({sb.client_ip})" + (f"; logs in {self.tmp} (kept)" if self.s.keep_logs else "")
        )
        self.worker = self._spawn(
            "worker", sb.cmd(sb.server, *self._turboctl("worker", "run", "--config", str(self.config)))
        )
        self.worker_rpc = ControlClient(f"{self.tmp}/worker.sock", timeout=2.0)
        self._wait(self.worker, lambda: self.worker_rpc.call("ping"), 180, "worker")
        self.log(f"worker: tiny model serving http://{sb.server_ip}:{WORKER_PORT}")
        return self

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs.clear()
        self.sandbox.delete()  # takes the veth pair and every qdisc on it along
        if self.s.keep_logs:
            self.log(f"logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> DemoNode:
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
            proc = subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def _wait(self, proc: subprocess.Popen, probe, timeout: float, name: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DemoError(f"the {name} exited ({proc.returncode}){self._log_hint(name)}")
            try:
                probe()
                return
            except ControlError:
                time.sleep(0.2)
        raise DemoError(f"the {name} did not come up in {timeout:.0f} s{self._log_hint(name)}")

    def _log_hint(self, name: str) -> str:
        """Where to look: the kept log's path, or (it is about to be removed) its last lines."""
        path = self.tmp / f"{name}.log"
        if self.s.keep_logs:
            return f": see {path}"
        return f"; the end of its log (--keep-logs keeps the whole):\n{_tail(path)}"

    def release(self, proc: subprocess.Popen) -> None:
        _stop(proc)
        self.procs.remove(proc)

    # ---- the two setups ----------------------------------------------------------------

    def plain_fifo(self) -> None:
        """What the node has without turbonode: one FIFO shaped to the link rate."""
        sb, rate = self.sandbox, str(parse_rate(self.s.rate))
        for args in (
            ("qdisc", "replace", "dev", sb.dev, "root", "handle", "1:", "htb", "default", "1"),
            (
                "class",
                "add",
                "dev",
                sb.dev,
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                f"{rate}bit",
                "quantum",
                "1514",
            ),
            ("qdisc", "add", "dev", sb.dev, "parent", "1:1", "pfifo", "limit", "1000"),
        ):
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
        started.append(
            self._spawn(
                "iperf3",
                sb.cmd(sb.server, "iperf3", "-c", sb.client_ip, "-P", str(self.s.bulk_flows), "-t", str(int(d) + 3)),
            )
        )
        if self.s.stress:
            started.append(
                self._spawn(
                    "stress-ng",
                    ["stress-ng", "--cpu", str(os.cpu_count() or 1), "--timeout", f"{int(d) + 2}s", "--quiet"],
                )
            )
        watcher = _AgentWatch(self.agent_rpc) if watch_agent else None
        try:
            argv = [
                sys.executable,
                "-m",
                "sandbox.loadgen",
                f"http://{sb.server_ip}:{WORKER_PORT}",
                "--duration",
                str(d),
                "--size",
                str(self.s.size),
                "--timeout",
                "30",
            ]
            for tier, n in self.s.clients.items():
                argv += ["--clients", f"{tier}={n}"]
            res = subprocess.run(sb.cmd(sb.client, *argv), env=self.env, capture_output=True, text=True, timeout=d + 60)
            if res.returncode != 0:
                raise DemoError(f"the load generator failed: {res.stderr.strip()[-2000:]}")
            outcomes = [Outcome(**o) for o in json.loads(res.stdout)]
        finally:
            if watcher:
                watcher.stop()
            for proc in started:
                self.release(proc)
        return {"tiers": summarize(outcomes), "agent": watcher.summary() if watcher else None}


class _AgentWatch:
    """Polls the agent's status during a phase: the highest level and the throttles it applied."""

    def __init__(self, rpc: ControlClient):
        self.rpc = rpc
        self.levels: list[int] = []
        self.throttles: list[dict] = []
        self.reasons: set[str] = set()
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
        return {
            "max_level": LEVELS[top],
            "reasons": sorted(self.reasons),
            "throttled_share": len(self.throttles) / len(self.levels) if self.levels else 0.0,
            "last_throttle": self.throttles[-1] if self.throttles else None,
        }


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
