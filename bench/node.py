"""A sandbox node for benchmarks and end-to-end tests: two network namespaces joined by veth
(sandbox/netns.py), the real worker (`turboctl worker run`, tiny model) with bench/garbage.py
installed in its process, and the agent shaping the sandbox device. Everything it starts is
stopped, and the datapath removed, on exit, also when the body raises.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sandbox.netns import Sandbox  # noqa: E402
from turbonode.errors import ControlError, TurbonodeError  # noqa: E402
from turbonode.jsonrpc import ControlClient  # noqa: E402

POLL_S = 0.01
LEVEL_LINE = re.compile(r"level (escalate|recover) (\w+) -> (\w+): (\w+)=([\d.e+-]+|n/a)")
# The real worker CLI, with the garbage thread installed in the same process first.
WORKER_PY = (
    "import sys; sys.argv[0] = 'turboctl'; from bench.garbage import Garbage; Garbage().install(); "
    "from turboctl import main; main()"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, step: float = POLL_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return None


def call(client: ControlClient, method: str, **params):
    try:
        return client.call(method, **params)
    except ControlError:
        return None


class Node:
    """Sandbox + worker + agent, all torn down on exit."""

    def __init__(self, tmp: str, period: float = 0.25, extra_toml: str = ""):
        self.tmp = str(tmp)
        self.period = period
        self.extra_toml = extra_toml  # appended to the config file, e.g. a [policy] table
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self.sandbox = Sandbox(prefix="tnb")
        self.worker = self.agent = None

    def __enter__(self) -> Node:
        sb = self.sandbox.create()
        try:
            return self._start(sb)
        except BaseException:
            self.__exit__()
            raise

    def _start(self, sb: Sandbox) -> Node:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        wsock, asock = f"{self.tmp}/worker.sock", f"{self.tmp}/agent.sock"
        cfg = Path(self.tmp, "turbonode.toml")
        cfg.write_text(
            f'[qos]\nrate = "100mbit"\n'
            f'[worker]\ncontrol_socket = "{wsock}"\nlisten = "127.0.0.1:{free_port()}"\nmax_batch = 2\n'
            f'[agent]\nsocket = "{asock}"\nworker_socket = "{wsock}"\nmetrics = "127.0.0.1:{free_port()}"\n'
            f"sample_period = {self.period}\nthrottle_ttl = 1.0\n{self.extra_toml}"
        )
        self.worker = self._spawn(
            [sys.executable, "-c", WORKER_PY, "worker", "run", "--config", str(cfg)], env, "worker.log"
        )
        self.worker_rpc = ControlClient(wsock, timeout=1.0)
        if not wait_for(lambda: call(self.worker_rpc, "ping"), 120, 0.2):
            raise TurbonodeError(f"worker did not start: {self.log('worker')[-2000:]}")
        self.agent = self._spawn(
            [
                sys.executable,
                "-m",
                "turboctl",
                "agent",
                "run",
                "--config",
                str(cfg),
                "--dev",
                sb.dev,
                "--netns",
                sb.server,
            ],
            env,
            "agent.log",
        )
        self.agent_rpc = ControlClient(asock, timeout=1.0, peer="agent")
        if not wait_for(lambda: call(self.agent_rpc, "status"), 60, 0.2):
            raise TurbonodeError(f"agent did not start: {self.log('agent')[-2000:]}")
        return self

    def _spawn(self, argv, env, log) -> subprocess.Popen:
        f = open(Path(self.tmp, log), "w")
        self._logs.append(f)
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        # The agent leaves the datapath in place on purpose (fail-static); the node does not.
        try:
            self.datapath().remove()
        except TurbonodeError:
            pass
        self.sandbox.delete()
        for f in self._logs:
            f.close()

    def datapath(self):
        from tc.datapath import Datapath

        return Datapath(self.sandbox.dev, self.sandbox.server)

    def log(self, name: str) -> str:
        return Path(self.tmp, f"{name}.log").read_text()

    def level_changes(self) -> list[tuple]:
        """(direction, from, to, first signal, its value) for every level change logged so far."""
        return LEVEL_LINE.findall(self.log("agent"))

    def throttle(self):
        st = call(self.worker_rpc, "status")
        return st and st.get("throttle")

    def settled(self) -> bool:
        st = call(self.agent_rpc, "status")
        return bool(st) and st["level"] == "normal" and not self.throttle()
