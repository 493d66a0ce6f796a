"""A sandbox node for benchmarks and end-to-end tests: two network namespaces joined by veth
(sandbox/netns.py), the real workers (`turboctl worker run`, tiny model; one, or several as
`[workers.a]`, `[workers.b]`, ... of one node) with bench/garbage.py installed in each process,
and the agent shaping the sandbox device. Everything it starts is stopped, and the datapath
removed, on exit, also when the body raises.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sandbox.demo import preflight  # noqa: E402
from sandbox.interrupt import exit_on_signals  # noqa: E402
from sandbox.netns import Sandbox  # noqa: E402
from turbonode.config.topology import DEFAULT_WORKER, instance_socket  # noqa: E402
from turbonode.errors import ControlError, TurbonodeError  # noqa: E402
from turbonode.jsonrpc import ControlClient  # noqa: E402

POLL_S = 0.01
# the agent's log of a level change: the node's or a worker's
LEVEL_LINE = re.compile(r"(node|worker \S+): level (escalate|recover) (\w+) -> (\w+): (\w+)=([\d.e+-]+|n/a)")
# The real worker CLI, with the garbage thread installed in the same process first.
WORKER_PY = (
    "import sys; sys.argv[0] = 'turboctl'; from bench.garbage import Garbage; Garbage().install(); "
    "from turboctl import main; main()"
)


def bench_start() -> Callable[[str], None]:
    """What a sandbox benchmark does before it builds anything: refuse early, naming what the
    machine lacks; let SIGTERM/SIGINT unwind its `with`s (what it made is removed); and its
    progress log, on stderr (stdout carries the report)."""
    preflight()
    exit_on_signals()
    return log_stderr


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    """Sandbox + workers + agent, all torn down on exit. One worker is the node's `default` (no
    [workers] tables), several are a, b, c, ...: `workers` and `worker_rpcs` by name."""

    def __init__(self, tmp: str, period: float = 0.25, extra_toml: str = "", workers: int = 1):
        self.tmp = str(tmp)
        self.period = period
        self.extra_toml = extra_toml  # appended to the config file, e.g. a [policy] table
        self.names = [DEFAULT_WORKER] if workers == 1 else [chr(ord("a") + i) for i in range(workers)]
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self.sandbox = Sandbox(prefix="tnb")
        self.workers: dict[str, subprocess.Popen] = {}
        self.worker_rpcs: dict[str, ControlClient] = {}
        self.agent: subprocess.Popen | None = None

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
        one = self.names == [DEFAULT_WORKER]
        tables = "" if one else "".join(f'[workers.{n}]\nlisten = "127.0.0.1:{free_port()}"\n' for n in self.names)
        cfg = Path(self.tmp, "turbonode.toml")
        cfg.write_text(
            f'[qos]\nrate = "100mbit"\n'
            f'[worker]\ncontrol_socket = "{wsock}"\nlisten = "127.0.0.1:{free_port()}"\nmax_batch = 2\n'
            f'[agent]\nsocket = "{asock}"\n'
            + (f'worker_socket = "{wsock}"\n' if one else "")
            + f'metrics = "127.0.0.1:{free_port()}"\n'
            f"sample_period = {self.period}\nthrottle_ttl = 1.0\n{self.extra_toml}{tables}"
        )
        for name in self.names:  # they load at once
            instance = [] if one else ["--instance", name]
            argv = [sys.executable, "-c", WORKER_PY, "worker", "run", "--config", str(cfg), *instance]
            self.workers[name] = self._spawn(argv, env, f"{self.log_name(name)}.log")
            self.worker_rpcs[name] = ControlClient(wsock if one else instance_socket(wsock, name), timeout=1.0)
        for name, rpc in self.worker_rpcs.items():
            if not wait_for(lambda rpc=rpc: call(rpc, "ping"), 180, 0.2):
                raise TurbonodeError(f"worker {name} did not start: {self.log(self.log_name(name))[-2000:]}")
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

    @property
    def worker(self) -> subprocess.Popen:
        """The first worker (the node's only one, or a)."""
        return self.workers[self.names[0]]

    @staticmethod
    def log_name(name: str) -> str:
        return "worker" if name == DEFAULT_WORKER else f"worker-{name}"

    def log(self, name: str) -> str:
        return Path(self.tmp, f"{name}.log").read_text()

    def level_changes(self) -> list[tuple]:
        """(scope, direction, from, to, first signal, its value) for every level change logged so far;
        scope is 'node' or 'worker NAME'."""
        return LEVEL_LINE.findall(self.log("agent"))

    def throttle(self, name: str | None = None):
        """The throttle in force at worker `name` (default: the first)."""
        st = call(self.worker_rpcs[name or self.names[0]], "status")
        return st and st.get("throttle")

    def settled(self) -> bool:
        st = call(self.agent_rpc, "status")
        return bool(st) and st["level"] == "normal" and not any(self.throttle(n) for n in self.names)
