"""Node SLO benchmark: turbo's end-to-end latency under every fault, plain node vs turbonode.

    flock /tmp/turbonode-bench.lock .venv/bin/python bench/node_slo.py [--cells none,cpu] [--requests 100]
        [--json FILE]

The sandbox node and client as `turboctl demo` builds them (agent/demo.py: two network
namespaces joined by veth, the node's side shaped to the link rate, the real worker on the
tiny model serving HTTP inside the node namespace). As under systemd, the worker runs in a
cgroup of its own, and batch work a user starts runs in a `batch` cgroup beside it. From the
client namespace, turbo requests arrive open-loop (Poisson, `--rate` per second, `--requests`
per cell) while closed-loop fast and relax clients keep the worker busy (bench/slo_load.py).

Each cell adds one fault (or all of them), bounded in time and inside the namespaces:
  none        no fault
  cpu         stress-ng on every CPU, in a session of its own (nice 0)
  cpu-batch   the same at nice 19 in the batch cgroup, where users run batch work
  softirq     UDP flood into the node (iperf3, 64-byte datagrams, unlimited rate)
  bulk        4 unmarked iperf3 TCP flows out of the node
  relax-flood 36 more closed-loop relax clients (>= 32 relax jobs queued)
  gc          cyclic garbage in the worker process (bench/garbage.py), re-armed every 5 s
  all         every fault above at once
and runs twice, side by side: `plain` (one FIFO shaped to the link rate, no agent) and
`turbonode` (the agent started for the cell: eBPF classifier under the HTB tiers, watching and
acting). Per cell and mode: turbo p50/p99/max with n, connect p99 (the handshake: where the
first packets were queued), lower tiers' images/s, and what the agent did. Target: with
turbonode, turbo p99 <= 2x the turbo p99 of the `none` cell (the idle reference) of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.demo import WORKER_PORT, DemoNode, DemoSettings, _AgentWatch, _stop, preflight  # noqa: E402
from turbonode.cgroups import CgroupError, CpuHierarchy  # noqa: E402
from turbonode.errors import ControlError, TurbonodeError  # noqa: E402
from turbonode.stats import percentile  # noqa: E402

CELLS = ("none", "cpu", "cpu-batch", "softirq", "bulk", "relax-flood", "gc", "all")
MODES = ("plain", "turbonode")
REFERENCE_CELL = "none"
TARGET_RATIO = 2.0
BACKGROUND = {"fast": 1, "relax": 2}
FLOOD_CLIENTS = 36  # relax-flood: closed-loop relax clients on top of the background
BULK_FLOWS = 4
UDP_STREAMS = 2
GC_REARM_S = 5.0  # bench/garbage.py stops a burst after MAX_BURST_S (10 s)
WARMUP_S = 3.0  # the fault runs this long before the first request
SETTLE_TIMEOUT_S = 60.0
BULK_PORT, UDP_PORT = 5301, 5302
# The worker as `turboctl worker run`, with bench/garbage.py's thread installed in its process
# (idle until SIGUSR1) and, for experiments, its torch intra-op threads pinned by --worker-threads.
WORKER_PY = (
    "import sys; sys.argv[0] = 'turboctl'; from bench.garbage import Garbage; Garbage().install()\n"
    "{threads}from agent.cli import main; main()"
)
THREADS_PY = "import torch, render.daemon as d; d.torch_threads = lambda: (torch.set_num_threads({n}), {n})[1]\n"


@dataclass
class Knobs:
    """How the node is set up besides the mode: what experiments vary."""

    worker_threads: int = 0  # 0: the worker's own choice
    omp_wait_policy: str = ""  # '' leaves the environment alone
    reflect_tos: bool = False  # net.ipv4.tcp_reflect_tos=1 in the node namespace
    nodelay: bool = True  # the client's TCP_NODELAY


@dataclass
class Fault:
    """Processes (and a re-arming thread) one cell started; `stop` ends them all."""

    procs: list = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    threads: list = field(default_factory=list)
    on_stop: list = field(default_factory=list)

    def stop(self) -> None:
        self.stop_event.set()
        for th in self.threads:
            th.join(10)
        for proc in reversed(self.procs):
            _stop(proc)
        for fn in self.on_stop:
            fn()


class SloNode(DemoNode):
    """The demo's node, with the worker in a cgroup of its own and a batch cgroup beside it."""

    def __init__(self, settings: DemoSettings, knobs: Knobs, log=print):
        super().__init__(settings, log)
        self.knobs = knobs
        self.hierarchy = CpuHierarchy.find()
        tag = self.sandbox.server
        self.worker_cgroup, self.batch_cgroup = f"/{tag}-worker", f"/{tag}-batch"
        self._cgroups: list[str] = []

    def start(self) -> SloNode:
        for cg in (self.worker_cgroup, self.batch_cgroup):
            self.hierarchy.create(cg)
            self._cgroups.append(cg)
        super().start()
        if self.knobs.reflect_tos:
            self.sandbox.run(self.sandbox.server, "sysctl", "-qw", "net.ipv4.tcp_reflect_tos=1")
        return self

    def close(self) -> None:
        try:
            super().close()
        finally:
            while self._cgroups:
                with contextlib.suppress(CgroupError):
                    self.hierarchy.remove(self._cgroups.pop())

    def _turboctl(self, *args: str) -> list[str]:
        if args[:1] != ("worker",):
            return super()._turboctl(*args)
        threads = THREADS_PY.format(n=self.knobs.worker_threads) if self.knobs.worker_threads else ""
        env = [f"OMP_WAIT_POLICY={self.knobs.omp_wait_policy}"] if self.knobs.omp_wait_policy else []
        return ["env", *env, sys.executable, "-c", WORKER_PY.format(threads=threads), *args]

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        if name == "worker":  # into its cgroup before `ip netns exec`, which hides /sys/fs/cgroup
            argv = in_cgroup(self.hierarchy.procs_file(self.worker_cgroup), *argv)
        return super()._spawn(name, argv)

    # ---- faults -------------------------------------------------------------------------

    def start_fault(self, cell: str, seconds: float) -> Fault:
        sb, fault = self.sandbox, Fault()
        ncpu, t = str(os.cpu_count() or 1), str(int(seconds) + 1)
        names = CELLS[1:-1] if cell == "all" else (cell,)
        if "cpu" in names:
            fault.procs.append(self._spawn("stress-ng", ["stress-ng", "--cpu", ncpu, "--timeout", f"{t}s", "--quiet"]))
        if "cpu-batch" in names:
            fault.procs.append(
                self._spawn(
                    "stress-ng-batch",
                    in_cgroup(
                        self.hierarchy.procs_file(self.batch_cgroup),
                        "nice",
                        "-n",
                        "19",
                        "stress-ng",
                        "--cpu",
                        ncpu,
                        "--timeout",
                        f"{t}s",
                        "--quiet",
                    ),
                )
            )
        if "softirq" in names:
            fault.procs.append(self._spawn("udp-server", sb.cmd(sb.server, "iperf3", "-s", "-p", str(UDP_PORT))))
            time.sleep(0.5)
            fault.procs.append(
                self._spawn(
                    "udp-flood",
                    sb.cmd(
                        sb.client,
                        "iperf3",
                        "-c",
                        sb.server_ip,
                        "-p",
                        str(UDP_PORT),
                        "-u",
                        "-b",
                        "0",
                        "-l",
                        "64",
                        "-P",
                        str(UDP_STREAMS),
                        "-t",
                        t,
                    ),
                )
            )
        if "bulk" in names:
            fault.procs.append(self._spawn("bulk-server", sb.cmd(sb.client, "iperf3", "-s", "-p", str(BULK_PORT))))
            time.sleep(0.5)
            fault.procs.append(
                self._spawn(
                    "bulk",
                    sb.cmd(
                        sb.server, "iperf3", "-c", sb.client_ip, "-p", str(BULK_PORT), "-P", str(BULK_FLOWS), "-t", t
                    ),
                )
            )
        if "gc" in names:

            def rearm() -> None:
                while not fault.stop_event.is_set():
                    self.worker.send_signal(signal.SIGUSR1)
                    fault.stop_event.wait(GC_REARM_S)

            fault.threads.append(threading.Thread(target=rearm, daemon=True))
            fault.threads[-1].start()
            fault.on_stop.append(lambda: self.worker.send_signal(signal.SIGUSR2))
        return fault

    # ---- one cell in one mode ------------------------------------------------------------

    def run_cell(self, cell: str, mode: str, requests: int, rate: float) -> dict:
        self.wait_idle()
        agent = watch = None
        if mode == "plain":
            self.plain_fifo()
        else:
            agent = self.start_agent()
        seconds = requests / rate * 1.5 + 60  # every fault ends by itself after this long
        fault = self.start_fault(cell, seconds) if cell != "none" else Fault()
        try:
            time.sleep(WARMUP_S if cell != "none" else 0)
            watch = _AgentWatch(self.agent_rpc) if agent else None
            clients = dict(BACKGROUND)
            if cell in ("relax-flood", "all"):
                clients["relax"] += FLOOD_CLIENTS
            t0 = time.monotonic()
            outcomes = self.load(requests, rate, clients)
            wall = time.monotonic() - t0
        finally:
            if watch:
                watch.stop()
            fault.stop()
            if agent:
                self._release(agent)
            else:
                self.remove_fifo()
        return summarize_cell(outcomes, wall, watch.summary() if watch else None)

    def load(self, requests: int, rate: float, clients: dict[str, int]) -> list[dict]:
        sb = self.sandbox
        argv = [
            sys.executable,
            str(ROOT / "bench" / "slo_load.py"),
            f"http://{sb.server_ip}:{WORKER_PORT}",
            "--rate",
            str(rate),
            "--probes",
            str(requests),
            "--size",
            str(self.s.size),
            "--timeout",
            "60",
        ]
        argv += [f"--clients={t}={n}" for t, n in clients.items()]
        if not self.knobs.nodelay:
            argv.append("--no-nodelay")
        res = subprocess.run(
            sb.cmd(sb.client, *argv), env=self.env, capture_output=True, text=True, timeout=requests / rate * 3 + 120
        )
        if res.returncode != 0:
            raise TurbonodeError(f"the load generator failed: {res.stderr.strip()[-2000:]}")
        return json.loads(res.stdout)

    def wait_idle(self) -> None:
        """Let the previous cell's leftover jobs finish (or be cancelled) before the next starts."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                tiers = self.worker_rpc.call("status")["tiers"]
                if not any(t["queued"] or t["in_flight"] for t in tiers.values()):
                    return
            except ControlError:
                pass
            time.sleep(0.5)
        self.log("warning: the worker did not drain before the next cell")


def in_cgroup(procs_file: str, *argv: str) -> list[str]:
    """argv that first moves itself into the cgroup (its children follow), then execs."""
    return ["sh", "-c", f'echo $$ > {procs_file} && exec "$@"', "sh", *argv]


# ---- figures -----------------------------------------------------------------------------


def summarize_cell(outcomes: list[dict], wall: float, agent: dict | None) -> dict:
    probes = [o for o in outcomes if o["kind"] == "probe"]
    ok = [o for o in probes if o["status"] == 200]
    lat = [o["latency_s"] for o in ok]
    connect = [o["connect_s"] for o in ok if o["connect_s"] is not None]
    inside = [o["elapsed_s"] for o in ok if o["elapsed_s"] is not None]
    lower = {}
    for tier in ("fast", "relax"):
        mine = [o for o in outcomes if o["kind"] == "background" and o["tier"] == tier]
        lower[tier] = {
            "ok": sum(o["status"] == 200 for o in mine),
            "refused": sum(o["status"] != 200 for o in mine),
            "images_per_s": sum(o["status"] == 200 for o in mine) / wall if wall > 0 else 0.0,
        }
    return {
        "turbo": {
            "n": len(ok),
            "sent": len(probes),
            "failed": len(probes) - len(ok),
            "p50_s": percentile(lat, 50),
            "p99_s": percentile(lat, 99),
            "max_s": max(lat, default=None),
            "connect_p50_s": percentile(connect, 50),
            "connect_p99_s": percentile(connect, 99),
            "worker_p50_s": percentile(inside, 50),
            "worker_p99_s": percentile(inside, 99),
        },
        "lower": lower,
        "wall_s": wall,
        "agent": agent,
        "outcomes": outcomes,
    }


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def report(result: dict) -> str:
    cells, modes = result["cells"], result["modes"]
    ref = cells.get(REFERENCE_CELL, {}).get("turbonode", {}).get("turbo", {}).get("p99_s")
    head = f"{'n':>4} {'p50':>6} {'p99':>6} {'max':>6} {'conn99':>6} {'fast/s':>6} {'relax/s':>7}"
    lines = [
        "turbo latency in ms (send to last byte, from the client namespace); lower tiers in images/s",
        f"{'cell':<12}" + "".join(f"  {m:^{len(head)}}" for m in modes) + "  p99/ref  agent",
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
            t, lo = r["turbo"], r["lower"]
            rates = f"{lo['fast']['images_per_s']:>6.2f} {lo['relax']['images_per_s']:>7.2f}"
            row += (
                f"  {t['n']:>4} {_ms(t['p50_s']):>6} {_ms(t['p99_s']):>6} {_ms(t['max_s']):>6} "
                f"{_ms(t['connect_p99_s']):>6} {rates}"
            )
        tn = by_mode.get("turbonode")
        ratio = tn["turbo"]["p99_s"] / ref if tn and ref and tn["turbo"]["p99_s"] is not None else None
        row += f"  {ratio:>7.2f}" if ratio is not None else f"  {'-':>7}"
        agent = (tn or {}).get("agent") or {}
        if agent:
            row += f"  {agent['max_level']}" + (f" ({', '.join(agent['reasons'])})" if agent["reasons"] else "")
            row += f", throttled {agent['throttled_share']:.0%}"
        lines.append(row)
        if ratio is not None:
            verdicts.append((cell, ratio))
    if ref:
        met = [c for c, r in verdicts if r <= TARGET_RATIO]
        missed = [f"{c} ({r:.2f}x)" for c, r in verdicts if r > TARGET_RATIO]
        lines.append(
            f"target: turbonode turbo p99 <= {TARGET_RATIO:g} x {REFERENCE_CELL} p99 ({_ms(ref)} ms) = "
            f"{_ms(ref * TARGET_RATIO)} ms: met in {len(met)}/{len(verdicts)} cells"
            + (f"; missed: {', '.join(missed)}" if missed else "")
        )
    lines.append(
        "conn99: p99 of the TCP handshake seen by the client (SYN -> SYN-ACK); "
        f"knobs: {result['knobs']}; load average before: {result['loadavg_before']}"
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {', '.join(CELLS)}")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--requests", type=int, default=100, help="turbo requests per cell and mode")
    ap.add_argument("--rate", type=float, default=1.0, help="turbo arrivals per second (Poisson)")
    ap.add_argument("--link", default="20mbit", help="the node's link rate, shaped in both modes")
    ap.add_argument("--worker-threads", type=int, default=0, help="torch intra-op threads (0: the worker's choice)")
    ap.add_argument("--omp-wait-policy", default="", choices=("", "ACTIVE", "PASSIVE"))
    ap.add_argument("--reflect-tos", action="store_true", help="net.ipv4.tcp_reflect_tos=1 in the node namespace")
    ap.add_argument("--no-nodelay", action="store_true", help="the client leaves Nagle on")
    ap.add_argument("--json", help="write every figure (and every request's outcome) here")
    ap.add_argument("--keep-logs", help="copy the node's logs (worker, agent, faults) to this directory")
    args = ap.parse_args()
    cells = [c for c in args.cells.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    bad = [c for c in cells if c not in CELLS] + [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown cell or mode: {', '.join(bad)}")
    if args.requests < 1 or args.rate <= 0:
        ap.error("--requests must be >= 1 and --rate positive")
    preflight()
    for sig in (signal.SIGTERM, signal.SIGINT):  # unwind through the `with`: everything is removed
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    knobs = Knobs(args.worker_threads, args.omp_wait_policy, args.reflect_tos, not args.no_nodelay)
    settings = DemoSettings(rate=args.link)
    result: dict = {
        "cells": {},
        "modes": modes,
        "knobs": knobs.__dict__,
        "requests": args.requests,
        "rate": args.rate,
        "link": args.link,
        "loadavg_before": os.getloadavg(),
    }

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    node = SloNode(settings, knobs, log)
    with node:
        try:
            for cell in cells:
                for mode in modes:
                    log(f"cell {cell}, {mode}: {args.requests} turbo requests at {args.rate:g}/s")
                    r = node.run_cell(cell, mode, args.requests, args.rate)
                    result["cells"].setdefault(cell, {})[mode] = r
                    t = r["turbo"]
                    log(f"  turbo n={t['n']} p50={_ms(t['p50_s'])} p99={_ms(t['p99_s'])} max={_ms(t['max_s'])} ms")
        finally:
            result["loadavg_after"] = os.getloadavg()
            if args.json:  # also what a failed or interrupted run measured so far
                Path(args.json).write_text(json.dumps(result, indent=1))
            if args.keep_logs:
                shutil.copytree(node.tmp, args.keep_logs, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
