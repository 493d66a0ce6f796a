"""The agent daemon: composition root. Builds the node's watchers and policy, one unit per
worker of the node (its watchers, policy, throttle lane and levers: agent/worker_unit.py), the
actuator, the status socket and the metrics endpoint from the configuration, then runs the
sampling loop.

Nothing on the node is touched before the agent holds what it owns (agent/ownership.py: its
socket, its workers, its device): a second agent is refused having changed nothing. In dry-run
it changes nothing at all: no mounts, no tree, no classifier, no pins; it logs what it would do.

Signal handlers only set a flag (and wake the loop through the wakeup fd). Sources that push
(PSI triggers, each worker's events) hand the loop file descriptors; when one fires the loop
samples at once rather than at its next tick. sd_notify
READY/WATCHDOG/STOPPING when run under systemd. On stop the datapath stays in place
(qos.keep_on_stop, fail-static); every worker's throttle is released and the relax ceil
restored so nothing stays degraded behind a stopped agent.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass

from turbonode import sdnotify
from turbonode.config import Config, node_workers
from turbonode.errors import TurbonodeError
from turbonode.rates import parse_rate
from turbonode.rpc_server import UnixRpcServer
from turbonode.tiers import tier

from . import metrics
from .actuator import Actuator
from .levers import LEVER_STATE_FILE, Levers
from .levers.cgroup import WorkerCgroup
from .levers.memory import best_effort_memory_cgroups
from .loop import AgentLoop
from .mounts import ensure_mounts
from .ownership import owned
from .policy import actions_table, policy_from_config
from .watchers.cpu import CpuWatcher
from .watchers.memory import MemoryWatcher
from .watchers.procfile import WorkerProcesses
from .watchers.psi import PsiTriggers, PsiWatcher
from .watchers.softirq import SoftirqWatcher
from .watchers.softnet import SoftnetWatcher
from .worker_unit import LANE_TIMEOUT_S, node_scope, worker_unit

log = logging.getLogger("turbonode.agent")


@dataclass
class Flags:
    stop: bool = False


def open_datapath(cfg: Config):
    """The QoS datapath on qos.dev, held for the agent's life (others' changes are refused);
    None when no device is configured. A dry-run agent holds nothing."""
    if not cfg.qos.dev:
        return None
    from tc.datapath import Datapath

    dp = Datapath(cfg.qos.dev, cfg.qos.netns or None)
    if not cfg.agent.dry_run:
        try:
            dp.require_caps()  # what applying needs, named before the agent touches anything
            dp.hold()
        except TurbonodeError:
            dp.close()
            raise
    return dp


def apply_datapath(dp, cfg: Config) -> None:
    """Apply the configured QoS (idempotent); in dry-run, log what applying would change."""
    if not cfg.agent.dry_run:
        done = dp.apply(cfg.qos)
        log.info(
            "datapath: %s, %s leaves, %d changes, classifier prog %s %s",
            doing(cfg),
            done["leaf_kind"],
            done["changes"],
            done["prog_id"],
            "compiled and attached" if done["compiled"] else "kept (already attached)",
        )
        return
    try:
        plan = dp.plan(cfg.qos)
    except TurbonodeError as exc:
        log.warning("dry-run: cannot read the QoS datapath: %s", exc)
        return
    for step in plan:
        log.info("dry-run: would %s on %s", step, cfg.qos.dev)
    if not plan:
        log.info("dry-run: the QoS datapath on %s is current", cfg.qos.dev)


def doing(cfg: Config) -> str:
    """What the agent does, for `systemctl status` (STATUS=)."""
    if not cfg.qos.dev:
        return "watching, no datapath (qos.dev unset)"
    where = f"{cfg.qos.dev} in netns {cfg.qos.netns}" if cfg.qos.netns else cfg.qos.dev
    if cfg.agent.dry_run:
        return f"dry-run, changing nothing; would shape {where} at {cfg.qos.rate}"
    return f"shaping {where} at {cfg.qos.rate}"


def build_loop(cfg: Config, datapath=None, gpu_nvml=None) -> AgentLoop:
    a = cfg.agent
    workers = [worker_unit(spec, cfg, gpu_nvml) for spec in node_workers(cfg)]

    def worker_pids() -> list[int]:  # the workers' own compute is no contention
        return [pid for u in workers for pid in u.feed.pids()]

    processes = WorkerProcesses(a.procfs, worker_pids)  # their /proc/PID/stat, read once a sample for both
    watchers = [
        CpuWatcher(a.procfs, processes=processes),
        PsiWatcher(a.procfs, PsiTriggers(a.procfs, cfg.policy.psi_trigger_us)),
        SoftnetWatcher(a.procfs),
        SoftirqWatcher(a.procfs, a.sysfs),
        MemoryWatcher(  # node-wide: the node's memory, every worker's major faults
            a.procfs,
            cgroup_root=cfg.levers.cgroup_root,
            worker_cgroup=cfg.levers.memory_worker_cgroup,
            best_effort=best_effort_memory_cgroups(cfg.levers),
            processes=processes,
        ),
    ]
    link = parse_rate(cfg.qos.rate)
    relax = tier("relax")
    state = cfg.levers.state_file or os.path.join(os.path.dirname(a.socket), LEVER_STATE_FILE)
    cgroups = [WorkerCgroup(u.name, u.spec.cgroup, u.feed.pid) for u in workers]
    levers = Levers(cfg.levers, state, cgroups, a.procfs, a.dry_run, worker_pids, a.sysfs)
    actuator = Actuator(
        a.throttle_ttl,
        a.dry_run,
        datapath,
        relax_rate_bps=link * cfg.qos.rate_pct.get("relax", relax.rate_pct) // 100,
        link_bps=link,
        levers=levers,
    )
    if datapath is not None:
        from .watchers.htb import HtbWatcher

        watchers.append(HtbWatcher(datapath))
    node_policy = policy_from_config(cfg.policy, node_scope)
    return AgentLoop(watchers, node_policy, actions_table(cfg.policy), actuator, workers, a.sample_period)


def run(cfg: Config, flags: Flags | None = None) -> int:
    flags = flags or Flags()
    a = cfg.agent
    with ExitStack() as stack:
        # first: nothing is touched before the agent holds what it owns
        stack.enter_context(owned(a, [w.control_socket for w in node_workers(cfg)]))
        datapath = open_datapath(cfg)
        if datapath is not None:
            stack.callback(datapath.close)  # our socket and lock only: the datapath stays in the kernel
        if os.geteuid() == 0:
            ensure_mounts(a.procfs, a.sysfs, dry_run=a.dry_run)
        if datapath is not None:
            apply_datapath(datapath, cfg)
        loop = build_loop(cfg, datapath)
        if loop.actuator.levers is not None:  # before any change of ours: what a killed agent left
            loop.actuator.levers.restore_leftovers()
        for w in loop.all_watchers():
            stack.callback(w.close)
        for unit in loop.workers:
            unit.lane.start()
        stack.callback(_shutdown, loop, cfg, datapath)
        status = UnixRpcServer(a.socket, {"status": loop.status, "ping": lambda: "pong"}, owner="agent").start()
        stack.callback(status.close)
        levers = loop.actuator.levers
        registry = metrics.build_registry(
            loop.watchers,
            loop.metrics_state,
            cfg.node.name,
            {u.name: u.watchers for u in loop.workers},
            levers.modes if levers is not None else None,
        )
        server = metrics.serve(registry, a.metrics)
        log.info("metrics on %s:%d/metrics, status on %s", *server.server_address[:2], a.socket)
        stack.callback(server.server_close)
        stack.callback(server.shutdown)
        _run_loop(loop, flags, a.sample_period, doing(cfg))
    return 0


def _run_loop(loop: AgentLoop, flags: Flags, period: float, what: str) -> None:
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    pushers = {fd: w for w in loop.all_watchers() for fd in w.wake_fds()}
    for w in loop.all_watchers():
        for fd, mask in w.wake_fds().items():
            poller.register(fd, mask)

    def on_signal(signum, _frame):
        flags.stop = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    old_fd = signal.set_wakeup_fd(wfd)
    watchdog = sdnotify.watchdog_interval()
    last_ping = 0.0
    ready = False
    log.info("agent running: sample period %.3f s, dry-run %s", period, loop.actuator.dry_run)
    try:
        due = time.monotonic()
        while not flags.stop:
            now = time.monotonic()
            loop.step(now)
            if not ready:  # READY once the first sample is published, so `status` is never empty
                sdnotify.notify(f"READY=1\nSTATUS={what}; {loop.describe()}")
                ready = True
            elif loop.changed:
                sdnotify.notify(f"STATUS={what}; {loop.describe()}")
            if watchdog and now - last_ping >= watchdog:
                sdnotify.notify("WATCHDOG=1")
                last_ping = now
            due = max(due + period, now)  # never try to catch up on missed ticks
            for fd, ev in poller.poll(max(0.0, due - time.monotonic()) * 1000):
                if fd == rfd:
                    while _drain(rfd):
                        pass
                elif ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    name = pushers[fd].name
                    log.warning("%s watcher: wakeup fd %d failed (poll events %#x); polled from now on", name, fd, ev)
                    poller.unregister(fd)
                else:
                    pushers[fd].woken(fd)
                    log.debug("%s watcher pushed: sampling now", pushers[fd].name)
                    due = time.monotonic()
    finally:
        sdnotify.notify("STOPPING=1")
        signal.set_wakeup_fd(old_fd)
        for s, h in old.items():
            signal.signal(s, h)
        os.close(rfd)
        os.close(wfd)


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _shutdown(loop: AgentLoop, cfg: Config, datapath) -> None:
    # every worker's release at once: one that does not answer costs its own lane's timeout only
    loop.shutdown(time.monotonic(), max(LANE_TIMEOUT_S, 2 * cfg.agent.sample_period) + 1)
    if loop.actuator.levers is not None:
        loop.actuator.levers.close()
    if datapath is not None and not cfg.qos.keep_on_stop and not cfg.agent.dry_run:
        try:
            datapath.remove()
        except TurbonodeError as exc:
            log.warning("removing the datapath failed: %s", exc)
