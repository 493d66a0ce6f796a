"""The worker's composition root: load the model, wire engine, HTTP API and control socket.

Signal handlers only set a flag (an asyncio Event). On SIGTERM/SIGINT the worker stops
taking jobs, fails those that have not started with a clear error, lets running ones
finish (up to `drain_timeout`), fails what is left, and exits; systemd hears READY,
STOPPING and WATCHDOG through sd_notify.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

from turbonode import sdnotify
from turbonode.config import split_host_port
from turbonode.errors import TurbonodeError

log = logging.getLogger(__name__)

WATCHDOG_STALL_S = 60.0  # an engine whose loop has not come round for this long is stuck


class ListenError(TurbonodeError):
    """The HTTP address could not be bound."""


def loading(what: str) -> None:
    """A start-up stage: logged, and shown by `systemctl status` until READY=1."""
    log.info("%s", what)
    sdnotify.notify(f"STATUS={what}")


def torch_threads() -> int:
    """One intra-op thread per CPU this process may run on: the engine is the only torch user."""
    import torch

    n = max(1, len(os.sched_getaffinity(0)))
    torch.set_num_threads(n)
    return n


class Worker:
    """Everything a running worker owns; `build` loads the model, `serve` runs until a signal."""

    def __init__(self, cfg, policy=None):
        from prometheus_client import CollectorRegistry

        from .backends.select import make_backend
        from .backends.tensorrt import TensorRTOptions
        from .encode_prompt import PromptEncoder
        from .engine import Engine, EngineSettings
        from .gc_telemetry import GcMonitor, freeze_after_load
        from .http_api import Api, RequestDefaults
        from .metrics import WorkerMetrics
        from .model import load_model

        self.cfg = cfg
        started = time.monotonic()
        loading(f"loading model {cfg.model}")
        torch_threads()
        family = load_model(cfg.model)
        log.info(
            "model %s loaded in %.1f s (%s family, %s)",
            family.model_id,
            time.monotonic() - started,
            family.name,
            family.fingerprint,
        )
        settings = EngineSettings.from_config(cfg, **({"policy": policy} if policy is not None else {}))
        settings.tier_defaults(family)  # a sampler the family cannot use fails here, before a backend is built
        started = time.monotonic()
        # tensorrt: a first start exports ONNX and builds engines (minutes; progress in the log)
        loading(f"preparing backend {cfg.backend} (device {cfg.device}) for model {family.model_id}")
        self.backend = make_backend(
            cfg.backend,
            family,
            cfg.device,
            tensorrt_options=TensorRTOptions.from_config(cfg, family.native_size),
        )
        info = self.backend.describe()
        log.info("backend %s on %s ready in %.1f s", info["name"], info["device"], time.monotonic() - started)
        encoder = PromptEncoder(family, self.backend.device, self.backend.dtype, cfg.text_cache_size)
        self.metrics = WorkerMetrics(CollectorRegistry())
        self.engine = Engine(self.backend, encoder, family, settings, metrics=self.metrics)
        self.metrics.watch(self.engine)
        defaults = RequestDefaults(
            cfg.size or family.native_size,
            self.engine.size_multiple,
            self.engine.defaults.steps,
            self.engine.defaults.guidance,
            size_check=self.backend.unsupported_size,
        )
        self.api = Api(self.engine, self.metrics.registry, defaults)
        self.backend_info = info
        del family
        freeze_after_load()
        self.gc = GcMonitor(observe=self.metrics.observe_gc)
        self.control = None
        self.address: tuple[str, int] | None = None

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> int:
        from aiohttp import web

        from .control_server import ControlHandlers, ControlServer

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.gc.install()
        self.engine.start()
        runner = web.AppRunner(self.api.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        host, port = split_host_port(self.cfg.listen)
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            self.control = ControlServer(
                self.cfg.control_socket,
                ControlHandlers(self.engine, self.gc, backend_info=self.backend_info),
                self.cfg.control_group,
            ).start()
        except OSError as exc:
            await self._shutdown(runner)
            raise ListenError(f"cannot listen on {self.cfg.listen}: {exc.strerror or exc}") from None
        except TurbonodeError:
            await self._shutdown(runner)
            raise
        bound = runner.addresses[0]
        self.address = (bound[0], bound[1])
        url = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
        serving = f"serving {url} (control {self.cfg.control_socket})"
        sdnotify.notify(f"READY=1\nSTATUS={serving}")
        log.info("%s", serving)
        if on_ready is not None:
            on_ready(url)
        watchdog = asyncio.create_task(self._watchdog())
        await stop.wait()
        watchdog.cancel()
        await self._drain(loop)
        await self._shutdown(runner)
        return 0

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop intake, fail what has not started, give running jobs `drain_timeout` to finish."""
        timeout = self.cfg.drain_timeout
        failed, running = self.engine.close_intake()
        sdnotify.notify(f"STOPPING=1\nSTATUS=draining {running} running jobs (up to {timeout:g} s)")
        log.info("draining: %d running jobs get up to %g s to finish; %d queued jobs failed", running, timeout, failed)
        started = time.monotonic()
        if await loop.run_in_executor(None, self.engine.wait_idle, timeout):
            log.info("drained in %.1f s", time.monotonic() - started)
            return
        n = self.engine.fail_all(f"the worker stopped before the job finished (drain timeout {timeout:g} s)")
        log.warning("drain timeout: failed %d unfinished jobs after %g s", n, timeout)

    async def _watchdog(self) -> None:
        interval = sdnotify.watchdog_interval()
        if interval is None:
            return
        while True:
            # ping only while the engine thread is alive and its loop keeps coming round
            if self.engine.alive and self.engine.clock() - self.engine.heartbeat < WATCHDOG_STALL_S:
                sdnotify.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _shutdown(self, runner) -> None:
        await runner.cleanup()
        if self.control is not None:
            self.control.close()
        self.engine.stop()
        self.gc.uninstall()


def run(cfg, on_ready: Callable[[str], None] | None = None, policy=None) -> int:
    """Build and serve a worker from a WorkerConfig; returns the exit status."""
    worker = Worker(cfg, policy)
    return asyncio.run(worker.serve(on_ready))
