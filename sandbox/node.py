"""The demo's sandbox node: two network namespaces (sandbox/netns.py), the real worker serving
HTTP inside the node namespace, and what a phase starts around it: the agent, bulk iperf3
flows, the stress-ng fault and the tiered image requests from the client namespace
(sandbox.loadgen). With `node_memory_mb`, the node's processes run under a memory cgroup of
that size (sandbox/node_memory.py). A worker that exits is started again after 2 s, as its
unit's Restart=on-failure would (an OOM kill, say). `close` stops every process it started by
PID and deletes the namespaces (and with them the qdiscs), its cgroups and its temporary
directory, also when a phase fails.
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

from turbonode.cgroups import V2_WEIGHT_MAX, CgroupError, CpuHierarchy
from turbonode.config import WorkerConfig, split_host_port
from turbonode.config_example import toml_value
from turbonode.errors import ControlError, TurbonodeError
from turbonode.jsonrpc import ControlClient
from turbonode.levels import LEVELS
from turbonode.rates import parse_rate
from turbonode.stats import percentile

from . import faults
from .interrupt import Closing
from .loadgen import Outcome, summarize
from .netns import Sandbox
from .node_memory import NodeMemory, evict_libraries
from .settings import DemoSettings

WORKER_PORT = split_host_port(WorkerConfig().listen)[1]
REQUEST_TIMEOUT_S = 30
RESTART_S = 2.0  # a worker that exits is started again after this long (its unit's RestartSec)
START_LIMIT = (5, 300.0)  # ...unless it exited this often within so many seconds (its unit's StartLimit*)


class DemoError(TurbonodeError):
    pass


class DemoNode(Closing):
    """The sandbox, the worker and whatever a phase starts; `close` undoes all of it."""

    def __init__(self, settings: DemoSettings, log=print, sandbox: Sandbox | None = None):
        self.s = settings
        self.log = log
        self.sandbox = sandbox or Sandbox(prefix="tnd")  # a fleet's node brings its own (sandbox/fleet.py)
        # named after the node's namespace, so a test can find it; removed on close unless keep_logs
        self.tmp = Path(tempfile.mkdtemp(prefix=f"turbonode-demo-{self.sandbox.server}-"))
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONUNBUFFERED": "1"}
        self.config = self.tmp / "turbonode.toml"
        # As under systemd, the worker runs in a cgroup of its own, and users' batch work in a
        # cgroup beside it: what the agent's cpu_share lever weighs against each other.
        try:
            self.cgroups: CpuHierarchy | None = CpuHierarchy.find()
        except CgroupError as exc:
            self.cgroups = None
            log(f"no cgroup CPU controller ({exc}): the worker shares its cgroup; cpu_share has nothing to favour")
        self.worker_cgroup = f"/{self.sandbox.server}-worker"
        self.batch_cgroup = f"/{self.sandbox.server}-batch"
        # The load generator stands for clients on other machines: in a cgroup of its own at the
        # top CPU weight, so that the node's CPU use (the worker's, raised by cpu_share) does not
        # slow the client's own reading and its delay is not counted as the node's latency.
        self.client_cgroup = f"/{self.sandbox.client}-client"
        self.agent_cgroup = f"/{self.sandbox.server}-agent"  # in the node's memory cgroup only
        self._made: list[str] = []
        self.memory = NodeMemory(
            self.sandbox.server,
            settings.node_memory_mb,
            {"worker": self.worker_cgroup, "batch": self.batch_cgroup},
            log,
        )
        self._roles = {self.worker_cgroup: "worker", self.batch_cgroup: "batch", self.agent_cgroup: "agent"}
        self.worker_exits: list[tuple[float, int]] = []  # (monotonic time, exit status) of each exit
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> DemoNode:
        sb = self.sandbox.create()
        if self.cgroups is not None:
            try:
                self._make_cgroups(self.cgroups)
            except (CgroupError, OSError) as exc:  # read-only in a container (systemd-nspawn), say
                self._remove_cgroups()
                self.cgroups = None
                self.log(f"cannot make the node's cgroups ({exc}): running without the cgroup lever")
        self.memory.make()
        worker = "".join(f"{k} = {toml_value(v)}\n" for k, v in self.s.worker_config.items())
        self.config.write_text(
            f'[qos]\ndev = "{sb.dev}"\nnetns = "{sb.server}"\nrate = "{self.s.rate}"\nkeep_on_stop = false\n'
            f'[worker]\nlisten = "0.0.0.0:{WORKER_PORT}"\ncontrol_socket = "{self.tmp}/worker.sock"\n'
            f'model = "tiny"\ndevice = "cpu"\nsize = {self.s.size}\nmax_batch = 4\ndrain_timeout = 2.0\n'
            # fewer steps than the defaults: more requests per phase, so p99 means something
            f"steps = {{ turbo = 2, fast = 4, other = 6, relax = 8 }}\n{worker}"
            f'[agent]\nsocket = "{self.tmp}/agent.sock"\nworker_socket = "{self.tmp}/worker.sock"\n'
            'metrics = "127.0.0.1:0"\n'
            "[levers]\n"
            + (f'best_effort_cgroups = ["{self.batch_cgroup}"]\n' if self.cgroups is not None else "")
            + self.memory.levers_toml()
            + self.s.extra_toml
        )
        self.log(
            f"node: netns {sb.server} ({sb.server_ip}, {sb.dev} shaped to {self.s.rate}); "
            f"client: netns {sb.client} ({sb.client_ip})" + (f"; logs in {self.tmp} (kept)" if self.s.keep_logs else "")
        )
        if self.memory.memory is not None:
            evict_libraries()  # the worker's reads charge its libraries to the node (sandbox/node_memory.py)
        self.worker = self.spawn(
            "worker", sb.cmd(sb.server, *self._turboctl("worker", "run", "--config", str(self.config)))
        )
        self.worker_rpc = ControlClient(f"{self.tmp}/worker.sock", timeout=2.0)
        self._wait(self.worker, lambda: self.worker_rpc.call("ping"), 180, "worker")
        self.log(f"worker: tiny model serving http://{sb.server_ip}:{WORKER_PORT}")
        self._supervisor = threading.Thread(target=self._supervise, args=(self.worker.args,), daemon=True)
        self._supervisor.start()
        return self

    def _supervise(self, argv: list[str]) -> None:
        """Start the worker again when it exits, as systemd would (Restart=on-failure)."""
        while not self._closing.wait(0.5):
            if self.worker.poll() is None:
                continue
            now = time.monotonic()
            self.worker_exits.append((now, self.worker.returncode))
            burst, interval = START_LIMIT
            if sum(now - at < interval for at, _ in self.worker_exits) > burst:
                self.log(f"the worker exited {burst + 1} times within {interval:g} s: not starting it again")
                return
            self.log(f"the worker exited ({self.worker.returncode}): starting it again in {RESTART_S:g} s")
            if self._closing.wait(RESTART_S):
                return
            self.worker = self.spawn("worker", argv, placed=True)

    def close(self) -> None:
        self._closing.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs.clear()
        self.sandbox.delete()  # takes the veth pair and every qdisc on it along
        self._remove_cgroups()
        self.memory.remove()
        if self.s.keep_logs:
            self.log(f"logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- helpers ---------------------------------------------------------------------

    def _make_cgroups(self, cgroups: CpuHierarchy) -> None:
        for cg in (self.worker_cgroup, self.batch_cgroup, self.client_cgroup):
            cgroups.create(cg)
            self._made.append(cg)
        path, _ = cgroups.weight_file(self.client_cgroup)
        Path(path).write_text(cgroups.weight_value(V2_WEIGHT_MAX))

    def _remove_cgroups(self) -> None:
        while self._made and self.cgroups is not None:
            try:
                self.cgroups.remove(self._made.pop())
            except CgroupError as exc:
                self.log(f"warning: {exc}")

    def _turboctl(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "turboctl", *args]

    def in_cgroup(self, cgroup: str, argv: list[str]) -> list[str]:
        """argv that first moves itself into `cgroup` (its children follow) in each hierarchy the
        node has it in (cpu; memory and io: sandbox/node_memory.py), then execs; as it is without
        any. Outermost: `ip netns exec` remounts /sys without the cgroups."""
        files = [self.cgroups.procs_file(cgroup)] if self.cgroups is not None and cgroup in self._made else []
        files += self.memory.procs_files(self._roles.get(cgroup, ""))
        if not files:
            return argv
        moves = " && ".join(f"echo $$ > {f}" for f in files)
        return ["sh", "-c", f'{moves} && exec "$@"', "sh", *argv]

    def spawn(self, name: str, argv: list[str], placed: bool = False) -> subprocess.Popen:
        """Start `argv` in a session of its own, logging to <name>.log; the worker and the agent in
        their cgroups (unless `placed`: argv already moves itself)."""
        roles = {"worker": self.worker_cgroup, "agent": self.agent_cgroup}
        if name in roles and not placed:
            argv = self.in_cgroup(roles[name], argv)
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
        agent = self.spawn("agent", self._turboctl("-v", "agent", "run", "--config", str(self.config)))
        self.agent_rpc = ControlClient(f"{self.tmp}/agent.sock", timeout=2.0, peer="agent")
        self._wait(agent, lambda: self.agent_rpc.call("status"), 120, "agent")
        return agent

    # ---- one phase -----------------------------------------------------------------------

    def run_load(self, watch_agent: bool) -> dict:
        """The faults and the tiered requests together: open-loop turbo probes for about
        `duration` seconds, closed-loop clients of the other tiers until the last is answered."""
        d = self.s.duration
        started = faults.start(self, ("bulk", "cpu") if self.s.stress else ("bulk",), d + 30)
        watcher = AgentWatch(self.agent_rpc) if watch_agent else None
        try:
            outcomes, wall = self.load(self.s.clients, max(1, round(d * self.s.turbo_rate)), self.s.turbo_rate)
        finally:
            if watcher:
                watcher.stop()
            for proc in started:
                self.release(proc)
        return {"tiers": summarize(outcomes, wall), "agent": watcher.summary() if watcher else None}

    def load(
        self,
        clients: dict[str, int],
        probes: int,
        rate: float,
        nodelay: bool = True,
        key: tuple[str, str] | None = None,
        probe_keys: list[tuple[str, str]] | None = None,
    ) -> tuple[list[Outcome], float]:
        """sandbox.loadgen from the client namespace: every outcome, and the seconds it ran.
        `key`, `probe_keys`: the API keys (name, key) it sends (sandbox.loadgen.run_load)."""
        sb = self.sandbox
        argv = [sys.executable, "-m", "sandbox.loadgen", f"http://{sb.server_ip}:{WORKER_PORT}"]
        argv += ["--size", str(self.s.size), "--timeout", str(REQUEST_TIMEOUT_S), "--probes", str(probes)]
        argv += ["--rate", str(rate), *(f"--clients={t}={n}" for t, n in clients.items())]
        if not nodelay:
            argv.append("--no-nodelay")
        if key:
            argv.append(f"--key={key[0]}={key[1]}")
        argv += [f"--probe-key={name}={k}" for name, k in probe_keys or ()]
        t0 = time.monotonic()
        res = subprocess.run(
            self.in_cgroup(self.client_cgroup, sb.cmd(sb.client, *argv)),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=probes / rate * 3 + REQUEST_TIMEOUT_S * 2,
        )
        if res.returncode != 0:
            raise DemoError(f"the load generator failed: {res.stderr.strip()[-2000:]}")
        return [Outcome(**o) for o in json.loads(res.stdout)], time.monotonic() - t0


# The signals a run reports (p50/p90 of what the agent saw): CPU busy fraction vs PSI stall, and
# the memory stall and the worker's major faults.
WATCHED_SIGNALS = ("cpu_load", "psi_cpu_some", "psi_memory_some", "worker_major_faults_per_s")


class AgentWatch:
    """Polls the agent's status during a phase: the highest level and the throttles it applied."""

    def __init__(self, rpc: ControlClient):
        self.rpc = rpc
        self.levels: list[int] = []
        self.throttles: list[dict] = []
        self.reasons: set[str] = set()
        self.levers: dict[str, int] = {}  # lever -> polls it was engaged at
        self.signals: dict[str, list[float]] = {}  # what the policy saw, per poll (WATCHED_SIGNALS)
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
            actions = st.get("actions") or {}
            throttle = actions.get("worker_throttle") or (actions.get("applied") or {}).get("throttle")
            if throttle:
                self.throttles.append(throttle)
            for name, lever in (actions.get("levers") or {}).items():
                if isinstance(lever, dict) and "engaged" in lever:
                    self.levers[name] = self.levers.get(name, 0) + bool(lever["engaged"])
            for name in WATCHED_SIGNALS:
                value = (st.get("signals") or {}).get(name)
                if isinstance(value, (int, float)):
                    self.signals.setdefault(name, []).append(float(value))

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
            "levers": {name: n / len(self.levels) for name, n in self.levers.items()} if self.levels else {},
            "signals_p50_p90": {
                name: [round(percentile(v, q) or 0.0, 3) for q in (50, 90)] for name, v in self.signals.items()
            },
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
