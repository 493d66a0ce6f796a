"""Node SLO benchmark: turbo's end-to-end latency under every fault, plain node vs turbonode.

    flock /tmp/turbonode-bench.lock .venv/bin/python bench/node_slo.py [--cells none,cpu] [--requests 100]
        [--workers 2] [--json FILE]

The sandbox node and client as `turboctl demo` builds them (sandbox/node.py: two network
namespaces joined by veth, the node's side shaped to the link rate, the real worker on the
tiny model serving HTTP inside the node namespace; as under systemd, the worker runs in a
cgroup of its own and batch work in a `batch` cgroup beside it). From the client namespace,
turbo requests arrive open-loop (Poisson, `--rate` per second, `--requests` per cell; the same
arrival times in every cell and mode, from `--seed`, so two cells differ by their fault only) while
closed-loop fast and relax clients keep the worker busy (sandbox/loadgen.py). The demo is
the short form of this benchmark: one cell (cpu + bulk), the same load and the same summary.
With `--blocks B` the cells run in turn B times, each time a share of `--requests` (block b's
arrivals from seed + 1000 b, the same in each cell of the block), and each cell is judged on its
blocks together: a machine that slows down during the run (a shared VM: the engine's p50 rose by a
fifth halfway through one 25-minute run here) then slows the `none` reference as much as the fault
cells, instead of only the cells that came later.

Each cell adds one fault (or all of them), bounded in time and inside the namespaces:
  none        no fault
  cpu         stress-ng on every CPU, in a session of its own (nice 0)
  cpu-batch   the same at nice 19 in the batch cgroup, where users run batch work
  softirq     UDP flood into the node (iperf3, 64-byte datagrams, unlimited rate)
  bulk        4 unmarked iperf3 TCP flows out of the node
  relax-flood 36 more closed-loop relax clients (>= 32 relax jobs queued)
  gc          cyclic garbage in the worker process (bench/garbage.py), re-armed every 5 s
  cpu-bulk    cpu and bulk at once (node-wide)
  all         every fault from cpu to gc at once
  all-but-gc  every fault from cpu to relax-flood at once
  memory      a job in the batch cgroup allocating until the node reclaims (PSI memory some
              > 10 %), then holding there
  memory-stream  a job in the batch cgroup reading a file twice the node's RAM through the page cache
  oom         a job in the batch cgroup growing past the node's RAM, retried 2 s after each kill
  io          a job in the batch cgroup writing with an fsync per MiB (a file of 512 MiB at most)
and runs twice, side by side: `plain` (one FIFO shaped to the link rate, no agent) and
`turbonode` (the agent started for the cell: eBPF classifier under the HTB tiers, watching and
acting). Per cell and mode: turbo p50/p99/max with n, connect p99 (the handshake: where the
first packets were queued), lower tiers' images/s, and what the agent did. Target: with
turbonode, turbo p99 <= 2x the turbo p99 of the `none` cell (the idle reference) of the same run,
and with one worker <= 1.2x in every fault cell (the tail users feel: `target tail`); in `oom`, no
turbo request fails with turbonode.

The node's processes (worker, agent, batch work) run under one memory cgroup of `--node-memory`
MiB that stands for the node's RAM (sandbox/node_memory.py), so reclaim and OOM happen inside
it; a worker that exits is started again after 2 s, as systemd would. The memory and io faults
are sandbox/pressure.py programs (sandbox/faults.py). Per cell the turbo requests that failed
(`err`), the worker's exits and the OOM kills per cgroup are counted, and the node's memory and
io stall, the worker's major faults, the node's busy CPUs (/proc/stat, all but idle and iowait)
and what the batch cgroup wrote (its io cgroup's counters) are measured in both modes (the
`node` line).

With `--workers N` the node runs N workers under one agent, as a multi-GPU node does (`[workers.a]`,
`[workers.b]`, ...: each its own port, socket and cgroup and, with as many CPUs, a CPU of its own),
and the same load arrives at each, `--requests` turbo requests per worker. The worker's own faults
(gc, relax-flood) hit worker a only; the others are node-wide. The report is per worker, against
its own `none` p99, with what the agent did to each. Targets: in `gc`, every worker but a keeps its
turbo p99 <= 1.1x its `none` p99 (a's storm does not spill), a itself <= 1.5x (its front's storm
must not take its engine's CPU) and only a is throttled (a's own rules act on a); in node-wide
cells every worker's p99 <= 2x its own `none`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.watchers.memory import process_major_faults  # noqa: E402
from agent.watchers.procfile import process_stat_fields  # noqa: E402
from agent.worker_unit import WORKER_SIGNALS  # noqa: E402
from bench import interval, slo  # noqa: E402
from bench.record import judged, ms_int, record, variant_of  # noqa: E402
from sandbox import faults  # noqa: E402
from sandbox.cgroup_v2 import CgroupV2Unavailable, cpu_on_v2  # noqa: E402
from sandbox.demo import preflight  # noqa: E402
from sandbox.loadgen import Outcome, summarize  # noqa: E402
from sandbox.node import AgentWatch, DemoNode  # noqa: E402
from sandbox.report import describe_agent  # noqa: E402
from sandbox.settings import DemoSettings  # noqa: E402
from turbonode.errors import ControlError  # noqa: E402
from turbonode.stats import percentile  # noqa: E402
from turbonode.tiers import PROTECTED_TIER  # noqa: E402

SINGLE = ("cpu", "cpu-batch", "softirq", "bulk", "relax-flood", "gc")
COMBINED = {"cpu-bulk": ("cpu", "bulk"), "all": SINGLE, "all-but-gc": SINGLE[:-1]}
OWN_FAULTS = ("gc", "relax-flood")  # faults of one worker (a, the first): the others are the node's
MEMORY = ("memory", "memory-stream", "oom", "io")  # issue 24: memory and io pressure
CELLS = ("none", *SINGLE, *COMBINED, *MEMORY)
MODES = ("plain", "turbonode")
FIRST_PACKET = ("listener", "reflect", "off")  # the worker's handshake_tier, tcp_reflect_tos, neither
REFERENCE_CELL = "none"
TARGET_RATIO = 2.0
TAIL_RATIO = 1.2  # one worker: the tail users feel, turbo's p99 in every fault cell against `none`
SPILL_RATIO = 1.1  # --workers: another worker's turbo p99 in `gc` (a's storm) against its own `none`
OWN_STORM_RATIO = 1.5  # --workers: a's turbo p99 in `gc`, its own storm, against its own `none`
BACKGROUND = {"fast": 1, "relax": 2}
FLOOD_CLIENTS = 36  # relax-flood: closed-loop relax clients on top of the background (>= 32 queued)
GC_REARM_S = 5.0  # bench/garbage.py stops a burst after MAX_BURST_S (10 s)
WARMUP_S = 3.0  # the fault runs this long before the first request...
MEMORY_WARMUP_S = 30.0  # ...the memory fault this long: it grows to where the node stalls first
SETTLE_TIMEOUT_S = 60.0
BLOCK_SEED_STEP = 1000  # --blocks: block b's arrivals come from seed + b * this (other seeds' blocks apart)
NODE_MEMORY_MB = 3072  # the node's RAM: what the worker, the agent and batch work share
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit
# The worker as `turboctl worker run`, with bench/garbage.py's thread installed in its process
# (idle until SIGUSR1: the gc fault).
WORKER_PY = (
    "import sys; sys.argv[0] = 'turboctl'; from bench.garbage import Garbage; Garbage().install(); "
    "from turboctl import main; main()"
)


@dataclass
class Knobs:
    """How the node is set up besides the mode: what experiments vary."""

    worker_threads: int = 0  # worker.intra_op_threads (0: the worker's default)
    omp_wait_policy: str = ""  # '' leaves the worker's default (render/cpu_threads.py)
    first_packet: str = "listener"  # FIRST_PACKET
    nodelay: bool = True  # the client's TCP_NODELAY
    agent_toml: str = ""  # more agent configuration, e.g. a [policy.rules.cpu_load] table
    torch_graphs: bool = True  # worker.torch_graphs: traced denoiser/VAE (False: eager, as before)
    # softirq knobs turbonode measured and left out (docs/agent.md), for the ablation: 0/'' leave them
    netdev_budget: int = 0  # net.core.netdev_budget (global: set for the run, restored after)
    rps_cpus: str = ""  # hex CPU mask for RPS on the node's veth receive queues
    # measured and left out for memory pressure (docs/agent.md): -1 leaves it
    swappiness: int = -1  # memory.swappiness of the node's memory cgroups (v1's own; ours, removed after)
    front_nice: int = -1  # worker.front_nice (-1: the worker's default)
    gc_out_of_band: bool = True  # worker.gc_out_of_band (False: CPython's own schedule, as before)


@dataclass
class Fault:
    """Processes (and a re-arming thread) one cell started; `stop` ends them all."""

    procs: list = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    threads: list = field(default_factory=list)
    on_stop: list = field(default_factory=list)

    def stop(self, node: DemoNode) -> None:
        self.stop_event.set()
        for th in self.threads:
            th.join(10)
        for proc in reversed(self.procs):
            node.release(proc)
        for fn in self.on_stop:
            fn()


class SloNode(DemoNode):
    """The demo's node with bench/garbage.py in the worker (for the gc fault)."""

    def __init__(self, settings: DemoSettings, knobs: Knobs, log=print):
        super().__init__(settings, log)
        self.knobs = knobs

    def start(self) -> SloNode:
        super().start()
        if self.knobs.first_packet == "reflect":
            self.sandbox.run(self.sandbox.server, "sysctl", "-qw", "net.ipv4.tcp_reflect_tos=1")
        if self.knobs.rps_cpus:  # sysfs as the node namespace sees it: its veth's queues
            queues = f"/sys/class/net/{self.sandbox.dev}/queues/rx-*/rps_cpus"
            write = f"for q in {queues}; do echo {self.knobs.rps_cpus} > $q; done"
            self.sandbox.run(self.sandbox.server, "sh", "-c", write)
        if self.knobs.swappiness >= 0:
            self.memory.set_swappiness(self.knobs.swappiness)
        return self

    def _turboctl(self, *args: str) -> list[str]:
        if args[:1] != ("worker",):
            return super()._turboctl(*args)
        env = [f"OMP_WAIT_POLICY={self.knobs.omp_wait_policy}"] if self.knobs.omp_wait_policy else []
        return ["env", *env, sys.executable, "-c", WORKER_PY, *args]

    def start_fault(self, cell: str, seconds: float) -> Fault:
        fault = Fault()
        names = COMBINED.get(cell, (cell,))
        fault.procs += faults.start(self, tuple(n for n in names if n in faults.FAULTS), seconds)
        if "gc" in names:  # in the first worker only
            victim = self.workers[0].proc
            assert victim is not None

            def rearm() -> None:
                while not fault.stop_event.is_set():
                    victim.send_signal(signal.SIGUSR1)
                    fault.stop_event.wait(GC_REARM_S)

            fault.threads.append(threading.Thread(target=rearm, daemon=True))
            fault.threads[-1].start()
            fault.on_stop.append(lambda: victim.send_signal(signal.SIGUSR2))
        return fault

    def run_cell(self, cell: str, mode: str, requests: int, rate: float, seed: int | None = None) -> CellRun:
        self.wait_idle()
        agent = watch = None
        before = self.counters()
        if mode == "plain":
            self.plain_fifo()
        else:
            agent = self.start_agent()
        seconds = requests / rate * 1.5 + 60  # every fault ends by itself after this long
        fault = self.start_fault(cell, seconds) if cell != "none" else Fault()
        try:
            time.sleep(MEMORY_WARMUP_S if cell == "memory" else WARMUP_S if cell != "none" else 0)
            watch = AgentWatch(self.agent_rpc) if agent else None
            clients = {w.name: dict(BACKGROUND) for w in self.workers}
            if "relax-flood" in COMBINED.get(cell, (cell,)):  # at the first worker only
                clients[self.workers[0].name]["relax"] += FLOOD_CLIENTS
            loads = self.load_all(clients, requests, rate, self.knobs.nodelay, seed)
        finally:
            if watch:
                watch.stop()
            fault.stop(self)
            if agent:
                self.release(agent)
            else:
                self.remove_fifo()
        return CellRun(loads, watch, (before, self.counters()))

    def counters(self) -> dict:
        """What the node has counted so far: stall seconds (PSI some totals), the workers' major
        faults per pid, their exits, OOM kills per memory cgroup."""
        stall = {}
        for res in ("memory", "io"):
            with open(f"/proc/pressure/{res}") as f:
                stall[res] = float(f.readline().rsplit("total=", 1)[1]) / 1e6
        faults = {}
        for w in self.workers:
            with contextlib.suppress(ControlError):
                for pid in (w.rpc.call("status") if w.rpc else {}).get("pids", []):
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        faults[pid] = process_major_faults(process_stat_fields(Path(f"/proc/{pid}/stat").read_text()))
        with open("/proc/stat") as f:  # cpu  user nice system idle iowait irq softirq steal ...
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return {
            "at": time.monotonic(),
            "cpu_busy_s": (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS,  # all but idle and iowait
            "batch_written": self.memory.written_bytes("batch"),
            "stall_s": stall,
            "major_faults": faults,
            "worker_exits": len(self.worker_exits),
            "oom_kills": self.memory.oom_kills(),
        }

    def wait_idle(self) -> None:
        """Let the previous cell's leftover jobs finish (or be cancelled) before the next starts."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                busy = [
                    t
                    for w in self.workers
                    if w.rpc
                    for t in w.rpc.call("status")["tiers"].values()
                    if t["queued"] or t["in_flight"]
                ]
                if not busy:
                    return
            except ControlError:
                pass
            time.sleep(0.5)
        self.log("warning: the workers did not drain before the next cell")


@dataclass
class CellRun:
    """A cell and mode as run once (with --blocks, one block of it): what each worker's load got
    (outcomes, wall seconds), what the agent said, and the node's counters before and after."""

    loads: dict[str, tuple[list[Outcome], float]]
    watch: AgentWatch | None
    counters: tuple[dict, dict]


# ---- figures -----------------------------------------------------------------------------


def summarize_runs(runs: list[CellRun]) -> dict:
    """A cell and mode's figures from its blocks together: every outcome, the walls added up, the
    agent's polls and the node's counters of every block."""
    loads: dict[str, tuple[list[Outcome], float]] = {}
    for run in runs:
        for name, (outcomes, wall) in run.loads.items():
            had, walled = loads.get(name, ([], 0.0))
            loads[name] = (had + outcomes, walled + wall)
    watches = [run.watch for run in runs if run.watch is not None]
    summary = None
    if watches:
        polls = AgentWatch(None)  # a fresh sum: a block's own watch stays as it saw its block
        for watch in watches:
            polls.absorb(watch)
        summary = polls.summary()
    events = node_events([run.counters for run in runs])
    if len(loads) == 1:
        ((outcomes, wall),) = loads.values()
        result = summarize_cell(outcomes, wall, summary)
        result["node"] = events
        return result
    return {
        "workers": {name: summarize_cell(outcomes, wall, None) for name, (outcomes, wall) in loads.items()},
        "wall_s": max(wall for _, wall in loads.values()),
        "agent": summary,
        "node": events,
    }


def node_events(spans: list[tuple[dict, dict]]) -> dict:
    """What happened on the node between pairs of `counters()` (a cell's blocks), all together:
    stall fractions, the worker's major faults per second (pids that lived through a pair, and the
    whole count of new ones), its exits, OOM kills per cgroup."""
    dt = max(1e-9, sum(after["at"] - before["at"] for before, after in spans))

    def added(field: Callable[[dict], float]) -> float:
        return sum(field(after) - field(before) for before, after in spans)

    faults = sum(
        n - before["major_faults"].get(pid, 0) for before, after in spans for pid, n in after["major_faults"].items()
    )
    cgroups = {k for _, after in spans for k in after["oom_kills"]}
    oom = {k: int(added(lambda c, k=k: c["oom_kills"].get(k, 0))) for k in sorted(cgroups)}
    written = None if any(a["batch_written"] is None for _, a in spans) else added(lambda c: c["batch_written"])
    return {
        "psi_some": {res: round(added(lambda c, r=res: c["stall_s"][r]) / dt, 4) for res in spans[0][0]["stall_s"]},
        "cpu_busy_cores": round(added(lambda c: c["cpu_busy_s"]) / dt, 2),
        "batch_write_mb_per_s": None if written is None else round(written / dt / 1e6, 1),
        "worker_major_faults_per_s": round(faults / dt, 1),
        "worker_exits": int(added(lambda c: c["worker_exits"])),
        "oom_kills": oom,
    }


def summarize_cell(outcomes: list[Outcome], wall: float, agent: dict | None) -> dict:
    """The demo's per-tier summary (sandbox.loadgen.summarize) plus, for turbo, where the time went."""
    tiers = summarize(outcomes, wall)
    turbo = [o for o in outcomes if o.tier == PROTECTED_TIER and o.status == 200]
    tiers.setdefault(PROTECTED_TIER, {}).update(
        {
            "connect_p50_s": percentile([o.connect_s for o in turbo if o.connect_s is not None], 50),
            "worker_p50_s": percentile([o.elapsed_s for o in turbo if o.elapsed_s is not None], 50),
            "worker_p99_s": percentile([o.elapsed_s for o in turbo if o.elapsed_s is not None], 99),
        }
    )
    return {
        "tiers": tiers,
        "slo": slo.attainments(outcomes),
        "wall_s": wall,
        "agent": agent,
        "outcomes": [asdict(o) for o in outcomes],
    }


def cell_slo(r: dict | None) -> dict | None:
    """A cell's SLO attainment per tier (runs saved before it was kept: from their outcomes)."""
    if r is None:
        return None
    if "slo" in r:
        return r["slo"]
    return slo.attainments(r["outcomes"]) if "outcomes" in r else None


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def report(result: dict) -> str:
    if result.get("workers", 1) > 1:
        return report_workers(result)
    cells, modes = result["cells"], result["modes"]
    ref_cell = cells.get(REFERENCE_CELL, {}).get("turbonode")
    ref = turbo_p99(ref_cell)
    head = (
        f"{'n':>4} {'err':>3} {'p50':>6} {'p99':>6} {'max':>6} {'turboSLO':>8} {'fastSLO':>7} "
        f"{'conn99':>6} {'fast/s':>6} {'relax/s':>7}"
    )
    lines = [
        "turbo latency in ms (send to last byte, from the client namespace); lower tiers in images/s; "
        f"turboSLO, fastSLO: the share of the tier's requests answered within {_objectives()} "
        "(refused and failed ones count as misses)",
        f"{'cell':<12}" + "".join(f"  {m:^{len(head)}}" for m in modes) + f"  p99/ref  {interval.LABEL:<9}  agent",
        f"{'':<12}" + "".join(f"  {head}" for _ in modes),
    ]
    verdicts = []
    for cell, by_mode in cells.items():
        row = f"{cell:<12}"
        for m in modes:
            r = by_mode.get(m)
            if r is None:
                row += "  " + " " * len(head)
                continue
            t = r["tiers"].get(PROTECTED_TIER, {})
            rates = " ".join(
                f"{(r['tiers'].get(tier) or {}).get('images_per_s') or 0:>{w}.2f}"
                for tier, w in (("fast", 6), ("relax", 7))
            )
            err = t.get("rejected", 0) + t.get("failed", 0)
            att = cell_slo(r) or {}
            row += (
                f"  {t.get('ok', 0):>4} {err:>3} {_ms(t.get('p50_s')):>6} {_ms(t.get('p99_s')):>6} "
                f"{_ms(t.get('max_s')):>6} {slo.pct(att.get(PROTECTED_TIER)):>8} {slo.pct(att.get('fast')):>7} "
                f"{_ms(t.get('connect_p99_s')):>6} {rates}"
            )
        tn = by_mode.get("turbonode")
        p99 = turbo_p99(tn)
        ratio = p99 / ref if p99 and ref else None
        row += f"  {ratio:>7.2f}" if ratio is not None else f"  {'-':>7}"
        row += f"  {_interval(tn, ref_cell):<9}"
        row += f"  {describe_agent(tn['agent'])}" if tn and tn.get("agent") else ""
        lines.append(row)
        events = {m: r["node"] for m in modes if (r := by_mode.get(m)) and r.get("node")}
        if events and (cell in MEMORY or any(describe_node(e, quiet=True) for e in events.values())):
            lines.append(f"{'':<12}  node: " + "; ".join(f"{m} {describe_node(e)}" for m, e in events.items()))
        if ratio is not None:
            verdicts.append((cell, ratio))
    if ref:
        missed = over_limit(verdicts, TARGET_RATIO)
        lines.append(
            f"target: turbonode turbo p99 <= {TARGET_RATIO:g} x {REFERENCE_CELL} p99 ({_ms(ref)} ms) = "
            f"{_ms(ref * TARGET_RATIO)} ms: met in {len(verdicts) - len(missed)}/{len(verdicts)} cells"
            + (f"; missed: {', '.join(missed)}" if missed else "")
        )
        faults = [(c, r) for c, r in verdicts if c != REFERENCE_CELL]
        over = over_limit(faults, TAIL_RATIO)
        lines.append(
            f"target tail: turbonode turbo p99 <= {TAIL_RATIO:g} x {REFERENCE_CELL} p99 = "
            f"{_ms(ref * TAIL_RATIO)} ms: met in {len(faults) - len(over)}/{len(faults)} fault cells"
            + (f"; missed: {', '.join(over)}" if over else "")
        )
    attained = {c: a for c, by_mode in cells.items() if (a := cell_slo(by_mode.get("turbonode")))}
    if attained:
        lines.append(slo.verdict_line(slo.verdict(attained)) + " (turbonode)")
    lines.append(
        "conn99: p99 of the TCP handshake seen by the client (SYN -> SYN-ACK); "
        f"knobs: {result['knobs']}; load average before: {result['loadavg_before']}"
    )
    return "\n".join(lines)


def over_limit(ratios: Iterable[tuple[str, float]], limit: float) -> list[str]:
    """The cells (or cell/worker) whose p99/ref is over `limit`, as the verdicts name them: 'all 1.24x'."""
    return [f"{cell} {ratio:.2f}x" for cell, ratio in ratios if ratio > limit]


def _objectives() -> str:
    return ", ".join(f"{tier} {s:g} s" for tier, s in slo.OBJECTIVE_S.items())


def turbo_p99(r: dict | None) -> float | None:
    return None if r is None else r["tiers"].get(PROTECTED_TIER, {}).get("p99_s")


def ratio_target(cell: str, name: str, first: str) -> float | None:
    """--workers: the bound on a worker's turbo p99 over its own `none` p99 in `cell`; None: no target
    (the reference, a's own faults)."""
    if cell == REFERENCE_CELL:
        return None
    if cell == "gc":  # a's storm: the others must not feel it, a must not feel it much
        return SPILL_RATIO if name != first else OWN_STORM_RATIO
    faults_here = set(COMBINED.get(cell, (cell,)))
    if faults_here <= set(OWN_FAULTS) or (name == first and faults_here & set(OWN_FAULTS)):
        return None
    return TARGET_RATIO  # the node's faults, and for the others a's too: none of them is theirs


def report_workers(result: dict) -> str:
    """--workers: turbo per worker and mode, against the worker's own `none` p99, and what the
    agent did to it; then the targets."""
    cells, modes = result["cells"], result["modes"]
    names = list(next(iter(cells.values()))[modes[0]]["workers"])
    ref_cells = {n: cells.get(REFERENCE_CELL, {}).get("turbonode", {}).get("workers", {}).get(n) for n in names}
    ref = {n: turbo_p99(r) for n, r in ref_cells.items()}
    head = f"{'n':>4} {'p50':>6} {'p99':>6} {'max':>6} {'turboSLO':>8} {'relax/s':>7}"
    lines = [
        f"turbo latency in ms per worker ({len(names)} workers, the load at each; send to last byte, from the "
        "client namespace); relax in images/s; p99/ref: the worker's turbonode p99 over its own none p99; "
        f"turboSLO: the share of turbo requests answered within {slo.OBJECTIVE_S[PROTECTED_TIER]:g} s",
        f"{'cell':<12} {'worker':<7}"
        + "".join(f"  {m:^{len(head)}}" for m in modes)
        + f"  p99/ref  {interval.LABEL:<9}  agent on this worker",
        f"{'':<12} {'':<7}" + "".join(f"  {head}" for _ in modes),
    ]
    spill, own_storm, own_only, nodewide, with_own = [], [], [], [], []
    attained: dict[str, dict] = {}
    for cell, by_mode in cells.items():
        for name in names:
            row = f"{cell:<12} {name:<7}"
            for m in modes:
                r = by_mode.get(m, {}).get("workers", {}).get(name)
                if r is None:
                    row += "  " + " " * len(head)
                    continue
                t = r["tiers"].get(PROTECTED_TIER, {})
                relax = (r["tiers"].get("relax") or {}).get("images_per_s") or 0
                figures = [_ms(t.get(k)) for k in ("p50_s", "p99_s", "max_s")]
                att = cell_slo(r) or {}
                if m == "turbonode" and att:
                    attained[f"{cell}/{name}"] = att
                row += (
                    f"  {t.get('ok', 0):>4} {figures[0]:>6} {figures[1]:>6} {figures[2]:>6} "
                    f"{slo.pct(att.get(PROTECTED_TIER)):>8} {relax:>7.2f}"
                )
            mine = by_mode.get("turbonode", {}).get("workers", {}).get(name)
            p99 = turbo_p99(mine)
            own_ref = ref[name]
            ratio = p99 / own_ref if p99 and own_ref else None
            row += f"  {ratio:>7.2f}" if ratio is not None else f"  {'-':>7}"
            row += f"  {_interval(mine, ref_cells[name]):<9}"
            seen = ((by_mode.get("turbonode") or {}).get("agent") or {}).get("workers", {}).get(name)
            if seen:
                why = f" ({', '.join(seen['reasons'])})" if seen["reasons"] else ""
                levers = ", ".join(f"{k} {v:.0%}" for k, v in sorted(seen["levers"].items()) if v)
                row += f"  {seen['max_level']}{why}, throttled {seen['throttled_share']:.0%}" + (
                    f", {levers}" if levers else ""
                )
            lines.append(row)
            if ratio is None or cell == REFERENCE_CELL:
                continue
            if cell == "gc" and seen:
                own_only.append((name, seen["throttled_share"], seen["reasons"]))
            limit = ratio_target(cell, name, names[0])
            if limit == SPILL_RATIO:
                spill.append((name, ratio))
            elif limit == OWN_STORM_RATIO:
                own_storm.append((name, ratio))
            elif limit == TARGET_RATIO:
                nodewide.append((cell, name, ratio))
            elif cell != "gc" and name == names[0] and not set(COMBINED.get(cell, (cell,))) <= set(OWN_FAULTS):
                with_own.append((cell, name, ratio))  # `all`: a's own faults too
    if spill:
        met = all(r <= SPILL_RATIO for _, r in spill)
        lines.append(
            f"target gc (a's storm does not spill): every other worker's p99 <= {SPILL_RATIO:g} x its none: "
            + ", ".join(f"{n} {r:.2f}x" for n, r in spill)
            + (" - met" if met else " - MISSED")
        )
    if own_storm:
        lines.append(
            f"target gc (a under its own storm): its p99 <= {OWN_STORM_RATIO:g} x its none: "
            + ", ".join(f"{n} {r:.2f}x" + (" - met" if r <= OWN_STORM_RATIO else " - MISSED") for n, r in own_storm)
        )
    if own_only:
        lines.append(
            "a's own rules act on a only: "
            + ", ".join(
                f"{n} throttled {share:.0%} ("
                + ", ".join(r + (" - its own" if r in WORKER_SIGNALS else "") for r in why)
                + ")"
                for n, share, why in own_only
            )
        )
    if nodewide:
        missed = over_limit(((f"{c}/{n}", r) for c, n, r in nodewide), TARGET_RATIO)
        lines.append(
            f"target node-wide faults: every worker's p99 <= {TARGET_RATIO:g} x its none: met in "
            f"{len(nodewide) - len(missed)}/{len(nodewide)}" + (f"; missed: {', '.join(missed)}" if missed else "")
        )
    if with_own:
        lines.append(
            f"with {names[0]}'s own faults too (no target: {', '.join(OWN_FAULTS)} are {names[0]}'s, not the node's): "
            + ", ".join(f"{c}/{n} {r:.2f}x" for c, n, r in with_own)
        )
    if attained:
        lines.append(slo.verdict_line(slo.verdict(attained)) + " (turbonode, per cell and worker)")
    lines.append(f"knobs: {result['knobs']}; load average before: {result['loadavg_before']}")
    return "\n".join(lines)


def result_record(result: dict) -> dict:
    """What bench/record.py keeps of a run: per cell, worker and mode turbo n, errors, p50/p99/max,
    the SLO attainment of turbo and fast, and the p99 over the `none` p99; the targets' verdicts."""
    multi = result.get("workers", 1) > 1
    rows, ratios, attained = [], [], {}
    for cell, by_mode in result["cells"].items():
        names = list(next(iter(by_mode.values())).get("workers", {"": None})) if multi else [""]
        for name in names:
            ref_cell = _figures(result["cells"].get(REFERENCE_CELL, {}).get("turbonode"), name)
            ref = turbo_p99(ref_cell)
            for mode, cell_result in by_mode.items():
                r = _figures(cell_result, name)
                if r is None:
                    continue
                t = r["tiers"].get(PROTECTED_TIER, {})
                att = cell_slo(r) or {}
                p99 = turbo_p99(r)
                ratio = round(p99 / ref, 2) if mode == "turbonode" and p99 and ref else None
                ends = interval.turbo_ratio_interval(r, ref_cell) if ratio is not None else None
                if mode == "turbonode":
                    attained[f"{cell}/{name}" if name else cell] = att
                    limit = ratio_target(cell, name, names[0]) if multi else None
                    if ratio is not None and (limit or (not multi and cell != REFERENCE_CELL)):
                        ratios.append((f"{cell}/{name}" if name else cell, ratio, limit or TARGET_RATIO, ends))
                rows.append(
                    [
                        cell,
                        *([name] if multi else []),
                        mode,
                        t.get("requests", 0),
                        t.get("rejected", 0) + t.get("failed", 0),
                    ]
                    + [ms_int(t.get(k)) for k in ("p50_s", "p99_s", "max_s")]
                    + [slo.pct(att.get(PROTECTED_TIER)), slo.pct(att.get("fast")), ratio, ends]
                )
    per_tier = slo.verdict(attained)
    missed = [f"{c} {r:.2f}x" for c, r, limit, _ in ratios if r > limit]
    verdicts = [
        {
            "target": f"turbonode turbo p99 <= {TARGET_RATIO:g}x the {REFERENCE_CELL} p99"
            + (
                f" (in gc: the first worker <= {OWN_STORM_RATIO:g}x, the others <= {SPILL_RATIO:g}x their own)"
                if multi
                else ""
            ),
            "value": f"met in {len(ratios) - len(missed)}/{len(ratios)}"
            + (f"; missed {', '.join(missed)}" if missed else ""),
            "met": not missed if ratios else None,
        }
    ]
    if not multi:
        over = over_limit(((c, r) for c, r, _, _ in ratios), TAIL_RATIO)
        verdicts.append(
            {
                "target": f"turbonode turbo p99 <= {TAIL_RATIO:g}x the {REFERENCE_CELL} p99, every fault cell (tail)",
                "value": f"met in {len(ratios) - len(over)}/{len(ratios)}"
                + (f"; missed {', '.join(over)}" if over else ""),
                "met": not over if ratios else None,
            }
        )
    verdicts += [
        {
            "target": f"{tier} SLO attainment >= {v['target']:.1%} within {slo.OBJECTIVE_S[tier]:g} s, every cell",
            "value": "no requests" if v["met"] is None else f"met in {v['cells'] - len(v['missed'])}/{v['cells']}",
            "met": v["met"],
        }
        for tier, v in per_tier.items()
    ]
    worst = max(ratios, key=lambda x: x[1], default=None)
    lowest = {
        tier: min(
            (a[tier]["attainment"] for a in attained.values() if a.get(tier) and a[tier]["attainment"] is not None),
            default=None,
        )
        for tier in slo.TIERS
    }
    return {
        "n": result["requests"],
        "n_per": "turbo requests per cell and mode" + (" and worker" if multi else ""),
        "seed": result.get("seed"),
        "headline": (
            "turbonode turbo SLO lowest "
            + ", ".join(f"{tier} {'-' if v is None else f'{v:.1%}'}" for tier, v in lowest.items())
            + (f"; worst p99/ref {_with_interval(worst)}" if worst else "")
        ),
        "figures": {
            **{f"lowest {tier} SLO attainment (turbonode)": v for tier, v in lowest.items()},
            "worst p99/ref (turbonode)": worst[1] if worst else None,
            "worst cell": worst[0] if worst else None,
            f"worst p99/ref {interval.LABEL}": worst[3] if worst else None,
            f"{REFERENCE_CELL} turbo p99 ms (turbonode)": ms_int(
                turbo_p99(result["cells"].get(REFERENCE_CELL, {}).get("turbonode"))
            )
            if not multi
            else None,
        },
        "table": {
            "columns": ["cell", *(["worker"] if multi else []), "mode", "turbo n", "err", "p50 ms", "p99 ms", "max ms"]
            + ["turbo SLO", "fast SLO", "p99/ref", f"p99/ref {interval.LABEL}"],
            "rows": rows,
        },
        **judged(verdicts),
    }


def _with_interval(ratio: tuple) -> str:
    """(cell, ratio, limit, interval) as the headline says it: '1.09x (relax-flood, 95% CI 0.82-1.31)'."""
    cell, value, _, ends = ratio
    return f"{value:.2f}x ({cell}" + (f", {interval.LABEL} {ends}" if ends else "") + ")"


def _interval(cell: dict | None, reference: dict | None) -> str:
    """The p99/ref column's interval, '-' where either cell kept no outcomes."""
    return interval.turbo_ratio_interval(cell, reference) or "-"


def _figures(cell_result: dict | None, name: str) -> dict | None:
    """A mode's figures in a cell: the node's, or with --workers the named worker's."""
    if cell_result is None or not name:
        return cell_result
    return cell_result.get("workers", {}).get(name)


def _answer_s(o: dict) -> float:
    return o.get("answer_s") or 0.0


# Where a turbo request's time went, from its outcome (client timings and the worker's own):
# the TCP handshake, the job in the worker's engine (submit -> finished), its answer made there
# (finished -> PNGs encoded, where the engine writes it; 0 where the front does), the rest before the
# first byte (the request read by the front and submitted, the head's way back: first byte -
# handshake - engine - answer) and the body on the wire (last byte - first byte).
STAGES = {
    "connect": lambda o: o["connect_s"],
    "engine": lambda o: o["elapsed_s"],
    "answer": _answer_s,
    "front": lambda o: o["first_byte_s"] - o["connect_s"] - o["elapsed_s"] - _answer_s(o),
    "body": lambda o: o["latency"] - o["first_byte_s"],
}


def stages(result: dict) -> str:
    """Per cell, mode and worker, p50/p99 ms of each stage of the answered turbo requests."""
    head = "".join(f" {name:>11}" for name in STAGES)
    lines = [f"where turbo's time went, p50/p99 ms (answered requests)\n{'cell':<12} {'mode':<9} {'worker':<6}{head}"]
    for cell, by_mode in result["cells"].items():
        for mode, r in by_mode.items():
            for worker, w in r.get("workers", {"": r}).items():
                done = [
                    o
                    for o in w["outcomes"]
                    if o["tier"] == PROTECTED_TIER
                    and o["status"] == 200
                    and None not in (o["connect_s"], o["elapsed_s"])
                ]
                row = f"{cell:<12} {mode:<9} {worker:<6}"
                for stage in STAGES.values():
                    values = [stage(o) for o in done]
                    row += f" {_ms(percentile(values, 50)) + '/' + _ms(percentile(values, 99)):>11}"
                lines.append(row)
    return "\n".join(lines)


def describe_node(events: dict, quiet: bool = False) -> str:
    """PSI some (memory, io), the worker's major faults/s, its exits, the node's busy CPUs, what the
    batch cgroup wrote and the OOM kills of a cell;
    with `quiet`, '' when nothing stands out."""
    kills = {k: n for k, n in (events.get("oom_kills") or {}).items() if n}
    psi = events.get("psi_some") or {}
    if quiet and not kills and not events.get("worker_exits") and max(psi.values(), default=0) < 0.01:
        return ""
    text = f"psi mem {psi.get('memory', 0):.2f} io {psi.get('io', 0):.2f}, "
    text += f"worker majflt {events.get('worker_major_faults_per_s', 0):g}/s, exits {events.get('worker_exits', 0)}"
    if events.get("cpu_busy_cores") is not None:  # runs saved before these were measured have none
        text += f", cpu busy {events['cpu_busy_cores']:.2f} cores"
    if events.get("batch_write_mb_per_s") is not None:
        text += f", batch writes {events['batch_write_mb_per_s']:g} MB/s"
    return text + (f", oom kills {', '.join(f'{k} {n}' for k, n in kills.items())}" if kills else "")


@contextlib.contextmanager
def netdev_budget(value: int):
    """net.core.netdev_budget = value (a global sysctl: no namespace has its own) while inside; 0 leaves it."""
    path = Path("/proc/sys/net/core/netdev_budget")
    if not value:
        yield
        return
    original = path.read_text().strip()
    path.write_text(str(value))
    try:
        yield
    finally:
        path.write_text(original)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {', '.join(CELLS)}")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--requests", type=int, default=100, help="turbo requests per cell and mode")
    ap.add_argument("--rate", type=float, default=1.0, help="turbo arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=22, help="the turbo arrivals' seed (the same in every cell and mode)")
    ap.add_argument(
        "--blocks",
        type=int,
        default=1,
        help="run the cells in turn this many times, --requests shared out among the blocks: a machine "
        "whose speed drifts during the run then slows every cell alike, the `none` reference included",
    )
    ap.add_argument("--link", default="20mbit", help="the node's link rate, shaped in both modes")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="workers on the node, each under the load (gc and relax-flood hit the first)",
    )
    ap.add_argument("--worker-threads", type=int, default=0, help="worker.intra_op_threads (0: its default)")
    ap.add_argument("--omp-wait-policy", default="", choices=("", "ACTIVE", "PASSIVE"))
    ap.add_argument("--front-nice", type=int, default=-1, help="worker.front_nice (-1: its default)")
    ap.add_argument(
        "--automatic-gc", action="store_true", help="worker.gc_out_of_band = false: CPython's own full collections"
    )
    ap.add_argument(
        "--first-packet",
        default="listener",
        choices=FIRST_PACKET,
        help="how a connection's first packets are marked: the worker's listening socket (its default), "
        "net.ipv4.tcp_reflect_tos=1 in the node namespace, or not at all",
    )
    ap.add_argument("--no-nodelay", action="store_true", help="the client leaves Nagle on")
    ap.add_argument("--eager", action="store_true", help="worker.torch_graphs = false: eager denoiser and VAE")
    ap.add_argument("--netdev-budget", type=int, default=0, help="net.core.netdev_budget for the run (0: leave it)")
    ap.add_argument("--rps-cpus", default="", help="hex CPU mask for RPS on the node's veth (default: leave it)")
    ap.add_argument(
        "--swappiness", type=int, default=-1, help="memory.swappiness of the node's memory cgroups (v1; -1: leave it)"
    )
    ap.add_argument(
        "--node-memory",
        type=int,
        default=NODE_MEMORY_MB,
        help="MiB of RAM the node has: its processes under a memory cgroup this large (0: none; the memory "
        "cells need it)",
    )
    ap.add_argument("--agent-toml", help="a TOML file of more agent configuration (e.g. [policy.rules.cpu_load])")
    ap.add_argument("--json", help="write every figure (and every request's outcome) here")
    ap.add_argument("--keep-logs", help="copy the node's logs (worker, agent, faults) to this directory")
    ap.add_argument(
        "--cgroup-v2",
        action="store_true",
        help="move the cpu controller to cgroup v2 for the run and back (sandbox/cgroup_v2.py; hybrid hosts)",
    )
    ap.add_argument("--report", metavar="JSON", help="print the tables of a run saved with --json; run nothing")
    args = ap.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(report(saved) + "\n" + stages(saved))
        return 0
    cells = [c for c in args.cells.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    bad = [c for c in cells if c not in CELLS] + [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown cell or mode: {', '.join(bad)}")
    if args.requests < 1 or args.rate <= 0 or args.workers < 1 or not 1 <= args.blocks <= args.requests:
        ap.error("--requests and --workers must be >= 1, --rate positive and --blocks from 1 to --requests")
    preflight()
    for sig in (signal.SIGTERM, signal.SIGINT):  # unwind through the `with`: everything is removed
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    knobs = Knobs(
        args.worker_threads,
        args.omp_wait_policy,
        args.first_packet,
        not args.no_nodelay,
        Path(args.agent_toml).read_text() if args.agent_toml else "",
        not args.eager,
        args.netdev_budget,
        args.rps_cpus,
        args.swappiness,
        args.front_nice,
        not args.automatic_gc,
    )
    worker: dict = {"handshake_tier": PROTECTED_TIER if knobs.first_packet == "listener" else ""}
    if knobs.worker_threads:
        worker["intra_op_threads"] = knobs.worker_threads
    if knobs.front_nice >= 0:
        worker["front_nice"] = knobs.front_nice
    if not knobs.torch_graphs:
        worker["torch_graphs"] = False
    if not knobs.gc_out_of_band:
        worker["gc_out_of_band"] = False
    if args.node_memory <= 0 and set(cells) & set(faults.MEMORY_FAULTS):
        ap.error("the memory cells need --node-memory: it bounds what they allocate")
    settings = DemoSettings(
        rate=args.link,
        worker_config=worker,
        extra_toml=knobs.agent_toml,
        node_memory_mb=args.node_memory,
        workers=args.workers,
    )
    result: dict = {
        "cells": {},
        "modes": modes,
        "knobs": knobs.__dict__,
        "requests": args.requests,
        "rate": args.rate,
        "seed": args.seed,
        "blocks": args.blocks,
        "link": args.link,
        "node_memory_mb": args.node_memory,
        "workers": args.workers,
        "loadavg_before": os.getloadavg(),
    }

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    with contextlib.ExitStack() as machine:
        if args.cgroup_v2:
            try:
                machine.enter_context(cpu_on_v2())
            except CgroupV2Unavailable as exc:
                log(f"--cgroup-v2: {exc}")
                return 2
        node = SloNode(settings, knobs, log)  # finds the cpu hierarchy: inside, so v2 where asked
        result["cgroup_version"] = node.cgroups.version if node.cgroups is not None else None
        run_cells(node, cells, modes, args, result, log)
    print(report(result) + "\n" + stages(result))
    record("node_slo", variant=variant_of(ap, args, ("cgroup_v2",)), **result_record(result))
    return 0


def block_plan(requests: int, blocks: int, seed: int | None) -> list[tuple[int, int | None]]:
    """(turbo requests, arrivals' seed) of each block: the requests shared out, the seed of block b
    `seed + b * BLOCK_SEED_STEP` (every cell and mode of a block has the same arrivals; one block:
    `seed` itself, as before blocks)."""
    share, extra = divmod(requests, blocks)
    return [(share + (b < extra), None if seed is None else seed + b * BLOCK_SEED_STEP) for b in range(blocks)]


def run_cells(node: SloNode, cells: list[str], modes: list[str], args: argparse.Namespace, result: dict, log) -> None:
    runs: dict[tuple[str, str], list[CellRun]] = {}
    with node, netdev_budget(node.knobs.netdev_budget):
        try:
            for b, (requests, seed) in enumerate(block_plan(args.requests, args.blocks, args.seed)):
                for cell in cells:
                    for mode in modes:
                        block = f" (block {b + 1}/{args.blocks})" if args.blocks > 1 else ""
                        log(f"cell {cell}, {mode}{block}: {requests} turbo requests at {args.rate:g}/s")
                        run = node.run_cell(cell, mode, requests, args.rate, seed)
                        runs.setdefault((cell, mode), []).append(run)
                        r = result["cells"].setdefault(cell, {})[mode] = summarize_runs(runs[(cell, mode)])
                        for name, w in r.get("workers", {"": r}).items():
                            t = w["tiers"].get(PROTECTED_TIER, {})
                            at = f" at {name}" if name else ""
                            log(f"  turbo{at} n={t.get('ok')} p50={_ms(t.get('p50_s'))} p99={_ms(t.get('p99_s'))} ms")
        finally:
            result["loadavg_after"] = os.getloadavg()
            if args.json:  # also what a failed or interrupted run measured so far
                Path(args.json).write_text(json.dumps(result, indent=1))
            if args.keep_logs:
                shutil.copytree(node.tmp, args.keep_logs, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))


if __name__ == "__main__":
    sys.exit(main())
