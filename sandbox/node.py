"""The demo's sandbox node: two network namespaces (sandbox/netns.py), the real workers (one,
or several as a multi-GPU node runs them: `[workers.<name>]`, each its own port, socket, cgroup
and, while there are enough CPUs, a CPU of its own) serving HTTP inside the node namespace, and
what a phase starts around them: the agent, bulk iperf3 flows, the stress-ng fault and the tiered
image requests from the client namespace (sandbox.loadgen, one load per worker). With
`node_memory_mb`, the node's processes run under a memory cgroup of that size
(sandbox/node_memory.py). A worker that exits is started again after 2 s, as its unit's
Restart=on-failure would (an OOM kill, say). `close` stops every process it started by PID and
deletes the namespaces (and with them the qdiscs), its cgroups and its temporary directory, also
when a phase fails.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from turbonode.cgroups import V2_WEIGHT_MAX, CgroupError, CpuHierarchy
from turbonode.config import DEFAULT_WORKER, WorkerConfig, split_host_port
from turbonode.config_example import toml_value
from turbonode.errors import ControlError, TurbonodeError
from turbonode.jsonrpc import ControlClient
from turbonode.levels import LEVELS
from turbonode.rates import parse_rate
from turbonode.stats import percentile

from . import cgroup_mount, faults
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


@dataclass
class SandboxWorker:
    """One worker of the sandbox node: `turboctl worker run --instance NAME` in a cgroup of its own."""

    name: str
    port: int
    socket: str
    cgroup: str
    cpus: str  # its own CPUs ('' : any)
    argv: list[str] = field(default_factory=list)  # what starts it (in its cgroup), again after an exit
    proc: subprocess.Popen | None = None
    rpc: ControlClient | None = None


def worker_names(n: int) -> list[str]:
    """One worker: the node's `default`, as a file naming none has; several: a, b, c, ..."""
    return [DEFAULT_WORKER] if n == 1 else [chr(ord("a") + i) for i in range(n)]


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
        pinned = 1 < settings.workers <= len(os.sched_getaffinity(0))  # each its own CPU while there are enough
        cpus = sorted(os.sched_getaffinity(0))
        self.workers = [
            SandboxWorker(
                name,
                WORKER_PORT + i,
                f"{self.tmp}/worker.sock" if settings.workers == 1 else f"{self.tmp}/worker-{name}.sock",
                self.node_cgroup("worker" if settings.workers == 1 else f"worker-{name}"),
                str(cpus[i]) if pinned else "",
            )
            for i, name in enumerate(worker_names(settings.workers))
        ]
        self.batch_cgroup = self.node_cgroup("batch")
        # The load generator stands for clients on other machines: in a cgroup of its own at the
        # top CPU weight, so that the node's CPU use (the worker's, raised by cpu_share) does not
        # slow the client's own reading and its delay is not counted as the node's latency.
        self.client_cgroup = f"/{self.sandbox.client}-client"
        self.agent_cgroup = self.node_cgroup("agent")  # here in the node's memory cgroup only
        self._made: list[str] = []
        self.memory = NodeMemory(
            self.sandbox.server,
            settings.node_memory_mb,
            # the workers share the node's `worker` memory and io cgroups; each has a cpu cgroup of its own
            {"worker": f"/{self.sandbox.server}-worker", "batch": self.batch_cgroup},
            log,
        )
        self._roles = {
            **{w.cgroup: "worker" for w in self.workers},
            self.batch_cgroup: "batch",
            self.agent_cgroup: "agent",
        }
        self.worker_exits: list[tuple[float, int]] = []  # (monotonic time, exit status) of each exit
        self._closing = threading.Event()
        self._supervisors: list[threading.Thread] = []
        self._loads: set[subprocess.Popen] = set()  # load generators running now (load_all ends them)

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
        tables = "".join(
            f"[workers.{w.name}]\n" + (f'cpus = "{w.cpus}"\n' if w.cpus else "")
            for w in self.workers
            if self.s.workers > 1
        )  # the sockets and ports follow from the names (turbonode.config.node_workers)
        self.config.write_text(
            f'[qos]\ndev = "{sb.dev}"\nnetns = "{sb.server}"\nrate = "{self.s.rate}"\nkeep_on_stop = false\n'
            f'[worker]\nlisten = "0.0.0.0:{WORKER_PORT}"\ncontrol_socket = "{self.tmp}/worker.sock"\n'
            f'model = "tiny"\ndevice = "cpu"\nsize = {self.s.size}\nmax_batch = 4\ndrain_timeout = 2.0\n'
            # fewer steps than the defaults: more requests per phase, so p99 means something
            f"steps = {{ turbo = 2, fast = 4, other = 6, relax = 8 }}\n{worker}"
            f'[agent]\nsocket = "{self.tmp}/agent.sock"\n'
            + (f'worker_socket = "{self.tmp}/worker.sock"\n' if self.s.workers == 1 else "")
            + 'metrics = "127.0.0.1:0"\n'
            "[levers]\n"
            + (f'best_effort_cgroups = ["{self.batch_cgroup}"]\n' if self.cgroups is not None else "")
            + self.memory.levers_toml()
            + self.s.extra_toml
            + tables
        )
        self.log(
            f"node: netns {sb.server} ({sb.server_ip}, {sb.dev} shaped to {self.s.rate}); "
            f"client: netns {sb.client} ({sb.client_ip})" + (f"; logs in {self.tmp} (kept)" if self.s.keep_logs else "")
        )
        if self.memory.memory is not None:
            evict_libraries()  # the workers' reads charge their libraries to the node (sandbox/node_memory.py)
        for w in self.workers:  # they load at once
            instance = ("--instance", w.name) if self.s.workers > 1 else ()
            run = self._turboctl("worker", "run", "--config", str(self.config), *instance)
            argv = sb.cmd(sb.server, *cgroup_mount.seeing(self.cgroups, run))
            w.argv = self.in_cgroup(w.cgroup, argv)
            w.proc = self.spawn(self.log_name(w), w.argv)
            w.rpc = ControlClient(w.socket, timeout=2.0)
        for w in self.workers:
            assert w.proc is not None and w.rpc is not None
            self._wait(w.proc, functools.partial(w.rpc.call, "ping"), 180, self.log_name(w))
            pinned = f" on CPU {w.cpus}" if w.cpus else ""
            self.log(f"worker {w.name}: tiny model serving http://{sb.server_ip}:{w.port}{pinned}")
        for w in self.workers:
            supervisor = threading.Thread(target=self._supervise, args=(w,), daemon=True)
            supervisor.start()
            self._supervisors.append(supervisor)
        return self

    def _supervise(self, w: SandboxWorker) -> None:
        """Start worker `w` again when it exits, as systemd would (Restart=on-failure)."""
        assert w.proc is not None
        while not self._closing.wait(0.5):
            if w.proc.poll() is None:
                continue
            now = time.monotonic()
            self.worker_exits.append((now, w.proc.returncode))
            burst, interval = START_LIMIT
            if sum(now - at < interval for at, _ in self.worker_exits) > burst:
                self.log(f"the workers exited {burst + 1} times within {interval:g} s: not starting {w.name} again")
                return
            self.log(f"worker {w.name} exited ({w.proc.returncode}): starting it again in {RESTART_S:g} s")
            if self._closing.wait(RESTART_S):
                return
            w.proc = self.spawn(self.log_name(w), w.argv)

    def close(self) -> None:
        self._closing.set()
        for supervisor in self._supervisors:
            supervisor.join(5)
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

    def node_cgroup(self, role: str) -> str:
        """The cpu cgroup of the node's `role` (a worker, its batch work): one of its own at the top."""
        return f"/{self.sandbox.server}-{role}"

    @staticmethod
    def log_name(w: SandboxWorker) -> str:
        return "worker" if w.name == DEFAULT_WORKER else f"worker-{w.name}"

    def _make_cgroups(self, cgroups: CpuHierarchy) -> None:
        for cg in (*(w.cgroup for w in self.workers), self.batch_cgroup, self.client_cgroup):
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
        any (`ip netns exec` inside it: sandbox/cgroup_mount.py)."""
        files = [self.cgroups.procs_file(cgroup)] if self.cgroups is not None and cgroup in self._made else []
        files += self.memory.procs_files(self._roles.get(cgroup, ""))
        if not files:
            return argv
        moves = " && ".join(f"echo $$ > {f}" for f in files)
        return ["sh", "-c", f'{moves} && exec "$@"', "sh", *argv]

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Start `argv` in a session of its own, logging to <name>.log; the agent in its cgroups
        (a worker's argv moves itself into its own: in_cgroup)."""
        if name == "agent":
            argv = self.in_cgroup(self.agent_cgroup, argv)
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
        `duration` seconds, closed-loop clients of the other tiers until the last is answered,
        at every worker; the tiers summed over the workers, and each worker's own."""
        d = self.s.duration
        started = faults.start(self, ("bulk", "cpu") if self.s.stress else ("bulk",), d + 30)
        watcher = AgentWatch(self.agent_rpc) if watch_agent else None
        try:
            loads = self.load_all(
                {w.name: self.s.clients for w in self.workers}, max(1, round(d * self.s.turbo_rate)), self.s.turbo_rate
            )
        finally:
            if watcher:
                watcher.stop()
            for proc in started:
                self.release(proc)
        every = [o for outcomes, _ in loads.values() for o in outcomes]
        wall = max(w for _, w in loads.values())
        return {
            "tiers": summarize(every, wall),
            "workers": {name: summarize(outcomes, w) for name, (outcomes, w) in loads.items()},
            "agent": watcher.summary() if watcher else None,
        }

    def load_all(
        self,
        clients: dict[str, dict[str, int]],
        probes: int,
        rate: float,
        nodelay: bool = True,
        seed: int | None = None,
    ) -> dict[str, tuple[list[Outcome], float]]:
        """One load per worker, all at once (`clients` per worker name): each worker's outcomes
        and the seconds its load ran. `seed`: the turbo arrivals' (worker i's: seed + i, so the
        workers' bursts are not the same ones), else new arrivals each time."""
        by_name = {w.name: w for w in self.workers}
        index = {w.name: i for i, w in enumerate(self.workers)}
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = {
                name: pool.submit(
                    self.load,
                    tiers,
                    probes,
                    rate,
                    nodelay,
                    port=by_name[name].port,
                    seed=None if seed is None else seed + index[name],
                    cpus=by_name[name].cpus,
                )
                for name, tiers in clients.items()
            }
            try:
                return {name: f.result() for name, f in futures.items()}
            except BaseException:
                # An interrupt (or one load's failure) ends the other loads now: leaving the pool
                # waits for its threads, and each would run its whole phase first (a Ctrl-C'd
                # demo took over 60 s to exit, tests/sandbox/test_demo.py).
                for proc in list(self._loads):
                    proc.kill()
                raise

    def load(
        self,
        clients: dict[str, int],
        probes: int,
        rate: float,
        nodelay: bool = True,
        key: tuple[str, str] | None = None,
        probe_keys: list[tuple[str, str]] | None = None,
        port: int = WORKER_PORT,
        seed: int | None = None,
        cpus: str = "",
    ) -> tuple[list[Outcome], float]:
        """sandbox.loadgen from the client namespace to the worker on `port`: every outcome, and
        the seconds it ran. `key`, `probe_keys`: the API keys (name, key) it sends; `seed`: the
        turbo arrivals' (sandbox.loadgen.run_load); `cpus`: the worker's own, when it has some.
        The load stands for clients on other machines; on a node of pinned workers it keeps to
        its worker's CPUs, so that one worker's saturated CPU does not push its client (and that
        client's packets' softirq) onto another worker's CPU: each CPU carries one worker and its
        client in every cell (bench/node_slo.py --workers)."""
        sb = self.sandbox
        argv = [sys.executable, "-m", "sandbox.loadgen", f"http://{sb.server_ip}:{port}"]
        argv += ["--size", str(self.s.size), "--timeout", str(REQUEST_TIMEOUT_S), "--probes", str(probes)]
        argv += ["--rate", str(rate), *(f"--clients={t}={n}" for t, n in clients.items())]
        if not nodelay:
            argv.append("--no-nodelay")
        if key:
            argv.append(f"--key={key[0]}={key[1]}")
        argv += [f"--probe-key={name}={k}" for name, k in probe_keys or ()]
        argv += ["--seed", str(seed)] if seed is not None else []
        argv += ["--cpus", cpus] if cpus else []
        t0 = time.monotonic()
        # subprocess.run's steps, with the process known to load_all while it runs
        with subprocess.Popen(
            self.in_cgroup(self.client_cgroup, sb.cmd(sb.client, *argv)),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            self._loads.add(proc)
            try:
                stdout, stderr = proc.communicate(timeout=probes / rate * 3 + REQUEST_TIMEOUT_S * 2)
            except BaseException:  # its time is up, or an interrupt here: it ends with this call
                proc.kill()
                raise
            finally:
                self._loads.discard(proc)
        if proc.returncode != 0:
            raise DemoError(f"the load generator failed (exit {proc.returncode}): {stderr.strip()[-2000:]}")
        return [Outcome(**o) for o in json.loads(stdout)], time.monotonic() - t0


# The signals a run reports (p50/p90 of what the agent saw): CPU busy fraction vs PSI stall, and
# the memory stall and the worker's major faults.
WATCHED_SIGNALS = ("cpu_load", "psi_cpu_some", "netrx_latency_p99_s", "psi_memory_some", "worker_major_faults_per_s")


class AgentWatch:
    """Polls the agent's status during a phase: the highest level and the throttles it applied,
    on the node and on each worker (what each worker's own rules did shows there)."""

    def __init__(self, rpc: ControlClient | None):
        """Polls `rpc` every 0.5 s until stopped; None: polls nothing, and holds what other watches
        saw (`absorb`)."""
        self.node = _Seen()
        self.workers: dict[str, _Seen] = {}
        self.signals: dict[str, list[float]] = {}  # what the policy saw, per poll (WATCHED_SIGNALS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if rpc is not None:
            self._thread = threading.Thread(target=self._run, args=(rpc,), daemon=True)
            self._thread.start()

    def _run(self, rpc: ControlClient) -> None:
        while not self._stop.wait(0.5):
            try:
                st = rpc.call("status")
            except ControlError:
                continue
            self.node.saw(
                st.get("level_index", 0),
                [r["signal"] for r in st.get("active", [])],
                None,
                (st.get("actions") or {}).get("levers") or {},
            )
            for name, w in (st.get("workers") or {}).items():
                self.workers.setdefault(name, _Seen()).saw(
                    w.get("level_index", 0),
                    [r["signal"] for r in w.get("active", [])],
                    w.get("sent") or w.get("applied"),
                    w.get("levers") or {},
                )
            for name in WATCHED_SIGNALS:
                value = (st.get("signals") or {}).get(name)
                if isinstance(value, (int, float)):
                    self.signals.setdefault(name, []).append(float(value))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def absorb(self, other: AgentWatch) -> None:
        """Another phase's polls (stopped) counted as this one's: a cell run in blocks."""
        self.node.absorb(other.node)
        for name, seen in other.workers.items():
            self.workers.setdefault(name, _Seen()).absorb(seen)
        for name, values in other.signals.items():
            self.signals.setdefault(name, []).extend(values)

    def summary(self) -> dict:
        """The node's (the highest level anywhere, every active rule, the levers of the node and,
        with one worker, its throttle) and each worker's."""
        workers = {name: seen.summary() for name, seen in self.workers.items()}
        out = {
            **self.node.summary(),
            "max_level": LEVELS[
                max([max(self.node.levels, default=0), *(max(s.levels, default=0) for s in self.workers.values())])
            ],
            "reasons": sorted(set(self.node.reasons).union(*(s.reasons for s in self.workers.values()))),
            "signals_p50_p90": {
                name: [round(percentile(v, q) or 0.0, 3) for q in (50, 90)] for name, v in self.signals.items()
            },
            "workers": workers,
        }
        if len(workers) == 1:  # the node's only worker: its throttle is the node's
            (only,) = workers.values()
            out.update(throttled_share=only["throttled_share"], last_throttle=only["last_throttle"])
            out["levers"] = {**out["levers"], **only["levers"]}
        return out


class _Seen:
    """What the agent said of one part (the node, a worker) poll by poll."""

    def __init__(self):
        self.levels: list[int] = []
        self.reasons: set[str] = set()
        self.throttles: list[dict] = []
        self.levers: dict[str, int] = {}

    def absorb(self, other: _Seen) -> None:
        self.levels += other.levels
        self.reasons |= other.reasons
        self.throttles += other.throttles
        _add_counts(self.levers, other.levers)

    def saw(self, level: int, active: list[str], throttle: dict | None, levers: dict) -> None:
        self.levels.append(level)
        self.reasons |= set(active)
        if throttle:
            self.throttles.append(throttle)
        for name, lever in levers.items():
            if isinstance(lever, dict) and "engaged" in lever:
                self.levers[name] = self.levers.get(name, 0) + bool(lever["engaged"])

    def summary(self) -> dict:
        polls = len(self.levels)
        return {
            "max_level": LEVELS[max(self.levels, default=0)],
            "reasons": sorted(self.reasons),
            "throttled_share": len(self.throttles) / polls if polls else 0.0,
            "last_throttle": self.throttles[-1] if self.throttles else None,
            "levers": {name: n / polls for name, n in self.levers.items()} if polls else {},
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


def _add_counts(into: dict[str, int], more: dict[str, int]) -> None:
    for name, n in more.items():
        into[name] = into.get(name, 0) + n
