"""The worker's composition root (its front): bind, start the engine process, wire HTTP API and control socket.

Bind first, then load: the HTTP server and the control socket are up before the model loads,
so a busy port or a live worker's socket is reported at once rather than minutes later, and
during the load GET /livez answers 200, GET /readyz and generation requests 503 "loading"
with Retry-After, /metrics shows the worker as not ready, and every control-socket method
answers an error saying the model is loading.

Signal handlers only set a flag (an asyncio Event), also during the load. On SIGTERM/SIGINT
the worker stops taking jobs (/readyz: 503 draining), fails those that have not started with
a clear error, lets running ones finish (up to `drain_timeout`), fails what is left, and
exits; systemd hears READY (once the model has loaded), STOPPING and WATCHDOG through sd_notify.

The model and the render loop run in the engine process (render/front/remote_engine.py, docs/worker.md
"Two processes"); when it dies, waiting requests fail and the front exits with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import ProcessCollector

from render.accounts import Accounts
from render.cpu_threads import wait_policy_default
from render.gc_telemetry import GcMonitor, freeze_after_load
from render.jobs import RequestDefaults
from render.memory_lock import MemoryLock
from render.weight import FULL_PCT
from turbonode import sdnotify
from turbonode.affinity import pin_cpus
from turbonode.config import DEFAULT_WORKER, WorkerConfig, split_host_port, weight_address
from turbonode.errors import TurbonodeError
from turbonode.exposition import daemon_registry
from turbonode.jsonrpc import SERVER_ERROR, WORKER_LOADING, RpcError
from turbonode.metric_names import ENGINE_PROCESS

from .control_server import ControlHandlers, ControlServer
from .full_collections import FullCollections
from .http_api import Api, listening_socket
from .http_log import MalformedRequestLog
from .listener_close import take_queue
from .metrics import WorkerMetrics
from .priority import front_nice, yield_to_engine
from .readiness import ENGINE_STALL_S
from .remote_engine import RemoteEngine
from .weight_agent import WeightAgent

log = logging.getLogger(__name__)

# At stop the listener closes first (a later client is refused at connect: nothing was sent, it
# may retry elsewhere), what its accept queue holds is served (render/front/listener_close.py); a
# connection accepted just before has this long for its request to arrive and be answered
# (503 draining) instead of being closed unanswered.
CLOSE_LINGER_S = 0.5


class ListenError(TurbonodeError):
    """The HTTP address could not be bound."""


def loading(what: str) -> None:
    """A start-up stage: logged, and shown by `systemctl status` until READY=1."""
    log.info("%s", what)
    sdnotify.notify(f"STATUS={what}")


def loading_handlers() -> dict[str, Callable[..., Any]]:
    """The control socket's methods while the model loads: each answers that it is loading.
    `ping` too: its callers (the agent, the demo, `turboctl worker ping`) take an answer as
    "ready"; the socket is bound this early only so that a live worker's is never taken over
    after a load of minutes."""

    def refuse(**_params: Any) -> Any:
        raise RpcError(SERVER_ERROR, WORKER_LOADING)

    return {"ping": refuse, "status": refuse, "throttle": refuse, "release": refuse}


class Worker:
    """Everything a running worker owns: `serve` binds, loads (`load`) and runs until a signal."""

    def __init__(self, cfg: WorkerConfig, policy=None, node: str = "", name: str = DEFAULT_WORKER):
        self.cfg, self.policy, self.name = cfg, policy, name
        self.backend_info: dict[str, Any] = {}
        registry, served = daemon_registry("worker", node, self._build_labels, worker=name)
        self.metrics = WorkerMetrics(registry)
        self.metrics.watch_load(cfg.capacity)
        # the keys file and the ledger: a bad keys file or an unwritable ledger file stops the start here
        self.accounts = Accounts.from_config(cfg, self.metrics)
        self.metrics.watch_accounts(self.accounts)
        self.api = Api(
            None,
            served,
            None,
            model_id=cfg.model,
            metrics=self.metrics,
            slo=cfg.slo,
            refuse_unready=cfg.refuse_unready,
            accounts=self.accounts,
        )
        self.engine: RemoteEngine | None = None  # the engine process, from the start of the load
        self.gc: GcMonitor | None = None
        self.full_collections: FullCollections | None = None  # from the load, where the front yields
        self.control: ControlServer | None = None
        self.defaults: RequestDefaults | None = None
        self.family = ""
        self.address: tuple[str, int] | None = None
        self.listener: socket.socket | None = None  # the HTTP listening socket, once bound
        self.weight_agent = WeightAgent(self.weight)
        self.weight_address: tuple[str, int] | None = None  # where HAProxy's agent-check asks, once bound
        self.malformed_log = MalformedRequestLog(self.metrics.http_malformed.inc)

    def _build_labels(self) -> dict[str, str]:
        """What build info adds once the model has loaded."""
        info = self.backend_info
        if not info:
            return {}
        return {"backend": info["name"], "device": info["device"], "model_family": self.family}

    def weight(self) -> int:
        """What the agent-check answers (render/weight.py): full until the model has loaded."""
        engine = self.api.engine
        if engine is None or not engine.alive:
            return FULL_PCT
        return engine.snapshot()["speed"]["weight_percent"]

    def load(self, engine: RemoteEngine) -> None:
        """Have the engine process load the model and build the engine (minutes for a first
        TensorRT build); then wire what the front serves to it."""
        engine.metrics = self.metrics
        info = engine.load(self.cfg, self.policy)
        d = info["defaults"]
        self.defaults = RequestDefaults(
            d["size"], d["size_multiple"], d["steps"], d["guidance"], size_check=engine.unsupported_size
        )
        self.backend_info = info["backend"]
        self.family = info["family"]
        self.metrics.watch(engine)
        ProcessCollector(namespace=ENGINE_PROCESS, pid=lambda: engine.pid, registry=self.metrics.registry)
        freeze_after_load()  # the front's own heap: its collections then traverse only new objects
        nice = front_nice(self.cfg.front_nice, len(os.sched_getaffinity(0)))
        if self.cfg.gc_out_of_band and nice > 0:  # where the front yields (docs/worker.md)
            full = FullCollections(on_run=self.metrics.full_collection_ran)
            if full.start():
                self.full_collections = full
        # after the engine process started: it keeps its nice, and so does the full collections' thread
        keep = self.full_collections.thread_ids() if self.full_collections is not None else ()
        yield_to_engine(nice, keep=keep)
        self.gc = GcMonitor(observe=self.metrics.observe_gc)
        engine.gc = self.gc

    async def _load(self, stop: asyncio.Event, engine: RemoteEngine) -> bool:
        """Wait for the load (in a thread) while the server answers; False when a signal came
        first: the caller's shutdown then kills the engine process, which ends the load."""
        loaded: asyncio.Future = asyncio.get_running_loop().run_in_executor(None, self.load, engine)
        stopped: asyncio.Future = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loaded, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not loaded.done():
            loaded.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is expected
            return False
        stopped.cancel()
        loaded.result()  # a load error propagates
        return True

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> int:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(self.api.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        self.malformed_log.install()
        host, port = split_host_port(self.cfg.listen)
        try:
            self.listener = listening_socket(host, port, self.cfg.handshake_tier)
            await web.SockSite(runner, self.listener).start()
        except OSError as exc:
            await self._shutdown(runner)
            raise ListenError(f"cannot listen on {self.cfg.listen}: {exc.strerror or exc}") from None
        weight_at = weight_address(self.cfg.listen, self.cfg.weight_port)
        if weight_at is not None:
            try:
                self.weight_address = await self.weight_agent.start(*weight_at)
            except OSError as exc:
                await self._shutdown(runner)
                raise ListenError(
                    f"cannot listen on {weight_at[0]}:{weight_at[1]} (worker.weight_port, HAProxy's agent-check): "
                    f"{exc.strerror or exc}"
                ) from None
        try:
            self.control = ControlServer(self.cfg.control_socket, loading_handlers(), self.cfg.control_group)
        except OSError as exc:
            await self._shutdown(runner)
            raise ListenError(f"cannot create {self.cfg.control_socket}: {exc.strerror or exc}") from None
        except TurbonodeError:
            await self._shutdown(runner)
            raise
        self.control.start()
        bound = runner.addresses[0]
        self.address = (bound[0], bound[1])
        url = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
        weight = f", agent-check port {self.weight_address[1]}" if self.weight_address else ""
        loading(f"listening on {url} (control {self.cfg.control_socket}{weight}), loading model {self.cfg.model}")
        gone = asyncio.Event()
        try:
            self.engine = RemoteEngine(on_exit=gone.set)
            loaded = await self._load(stop, self.engine)
        except BaseException:
            await self._shutdown(runner)
            raise
        if not loaded:
            log.info("stopped while loading the model")
            await self._shutdown(runner)
            return 0
        engine, gc = self.engine, self.gc
        assert engine is not None and gc is not None and self.control is not None and self.defaults is not None
        gc.install()
        self.api.full_collections = self.full_collections
        handlers = ControlHandlers(
            engine, gc, started=started, backend_info=self.backend_info, readiness=self.api.readiness, name=self.name
        )
        self.control.handlers.update(handlers.table())
        self.api.attach(engine, self.defaults)
        serving = f"serving {url} (control {self.cfg.control_socket})"
        sdnotify.notify(f"READY=1\nSTATUS={serving}")
        log.info("%s", serving)
        if on_ready is not None:
            on_ready(url)
        watchdog = asyncio.create_task(self._watchdog())
        memory_lock = asyncio.create_task(self._keep_memory_lock(engine))
        await asyncio.wait(
            {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(gone.wait())},
            return_when=asyncio.FIRST_COMPLETED,
        )
        watchdog.cancel()
        memory_lock.cancel()
        if gone.is_set():
            # a failed worker, for its service manager to restart: waiting jobs have failed
            log.error("the engine process exited (status %s); stopping", engine.process.returncode)
            await self._shutdown(runner)
            return 1
        await self._drain(engine)
        await self._shutdown(runner)
        return 0

    async def _drain(self, engine: RemoteEngine) -> None:
        """Stop intake, fail what has not started, give running jobs `drain_timeout` to finish."""
        timeout = self.cfg.drain_timeout
        failed, running = await engine.close_intake()
        sdnotify.notify(f"STOPPING=1\nSTATUS=draining {running} running jobs (up to {timeout:g} s)")
        log.info("draining: %d running jobs get up to %g s to finish; %d queued jobs failed", running, timeout, failed)
        started = time.monotonic()
        if await engine.wait_idle(timeout):
            log.info("drained in %.1f s", time.monotonic() - started)
            return
        n = await engine.fail_all(f"the worker stopped before the job finished (drain timeout {timeout:g} s)")
        log.warning("drain timeout: failed %d unfinished jobs after %g s", n, timeout)

    async def _keep_memory_lock(self, engine: RemoteEngine) -> None:
        """The front's pages locked while the throttle asks, unlocked once it expires (render/memory_lock.py)."""
        while True:
            engine.keep_memory_lock()
            await asyncio.sleep(MemoryLock.PERIOD_S)

    async def _watchdog(self) -> None:
        interval = sdnotify.watchdog_interval()
        if interval is None:
            return
        engine = self.engine
        assert engine is not None

        def turning() -> bool:  # asks the engine process: in a thread, off the event loop
            return engine.alive and engine.clock() - engine.heartbeat < ENGINE_STALL_S

        loop = asyncio.get_running_loop()
        while True:
            # ping only while the engine thread is alive and its loop keeps coming round
            if await loop.run_in_executor(None, turning):
                sdnotify.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _shutdown(self, runner) -> None:
        await self.weight_agent.close()
        if runner.addresses:  # listening: close the listener, then answer who got in before it closed
            assert self.listener is not None
            # take the queue and close with no await between (render/front/listener_close.py):
            # site.stop() closes the listener before its first await
            queued = take_queue(self.listener)
            for site in runner.sites:
                await site.stop()
            loop = asyncio.get_running_loop()
            for conn in queued:
                await loop.connect_accepted_socket(runner.server, conn)
            await asyncio.sleep(CLOSE_LINGER_S)
        await runner.cleanup()
        self.malformed_log.uninstall()
        if self.control is not None:
            self.control.close()
        if self.engine is not None:
            await self.engine.stop()
        if self.full_collections is not None:
            self.full_collections.stop()
        if self.gc is not None:
            self.gc.uninstall()


def run(
    cfg: WorkerConfig,
    on_ready: Callable[[str], None] | None = None,
    policy=None,
    node: str = "",
    name: str = DEFAULT_WORKER,
    cpus: frozenset[int] = frozenset(),
) -> int:
    """Serve a worker from a WorkerConfig until a signal; returns the exit status. `node` names the
    node in the metrics' `node` label ('' = the hostname), `name` the worker in their `worker`
    label; `cpus`, when given, are the only CPUs it (and its engine process) runs on."""
    pin_cpus(cpus)  # first: the engine process inherits it, and sizes its threads to it
    if "torch" not in sys.modules:  # OpenMP reads its wait policy once, when torch loads it
        wait_policy_default()
    worker = Worker(cfg, policy, node, name)
    return asyncio.run(worker.serve(on_ready))
