"""Helpers for the worker tests: one tiny model of each family per process, engines, an in-process server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading

from render.engine.backends.select import make_backend
from render.engine.encode_prompt import PromptEncoder
from render.engine.scheduler import Engine, EngineSettings
from render.front.http_api import Api, listening_socket
from render.front.metrics import WorkerMetrics
from render.jobs import JobRequest, RequestDefaults
from tests.family_support import SIZE, family


@functools.cache
def backend(model: str = "tiny"):
    """The torch backend as the worker runs it: graphs prepared for the default size (SIZE here)."""
    b = make_backend("torch", family(model), "cpu")
    b.prepare(SIZE, SIZE)
    return b


def make_engine(*, model="tiny", clock=None, on_event=None, backend_=None, metrics=None, **settings) -> Engine:
    kwargs = {"clock": clock} if clock is not None else {}
    fam = family(model)
    b = backend_ or backend(model)
    encoder = PromptEncoder(fam, b.device, b.dtype, capacity=16)
    return Engine(b, encoder, fam, EngineSettings(**settings), metrics=metrics, on_event=on_event, **kwargs)


def req(tier="relax", steps=3, seed=1, prompt="a red cat", guidance=None, n=1, size=SIZE, **kw) -> JobRequest:
    if guidance is None:
        guidance = 0.0 if tier == "turbo" else 7.5
    return JobRequest(
        prompt=prompt, tier=tier, steps=steps, seed=seed, guidance=guidance, width=size, height=size, n=n, **kw
    )


def drain(engine: Engine, jobs, limit: int = 500) -> None:
    """Run boundaries until every job is terminal (bounded)."""
    for _ in range(limit):
        if all(j.state.terminal for j in jobs):
            return
        engine.run_once()
    raise AssertionError(f"jobs not finished after {limit} boundaries: {[j.state for j in jobs]}")


class Served:
    def __init__(self, engine, metrics, url, port, api):
        self.engine, self.metrics, self.url, self.port, self.api = engine, metrics, url, port, api


@contextlib.contextmanager
def serve(
    engine: Engine | None = None,
    api_settings: dict | None = None,
    handshake_tier: str = "turbo",
    accounts=None,
    **settings,
):
    """The real aiohttp app on 127.0.0.1:<ephemeral> in a background thread, engine thread running.
    `accounts(metrics)` makes the API's render.accounts.Accounts (default: open, no keys)."""
    from aiohttp import web

    metrics = WorkerMetrics()
    engine = engine or make_engine(metrics=metrics, **settings)
    engine.metrics = metrics
    metrics.watch(engine)
    defaults = RequestDefaults(SIZE, engine.size_multiple, engine.defaults.steps, engine.defaults.guidance)
    api_settings = dict(api_settings or {})
    if accounts is not None:
        api_settings["accounts"] = accounts(metrics)
        metrics.watch_accounts(api_settings["accounts"])
    api = Api(engine, metrics.registry, defaults, metrics=metrics, **api_settings)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def start():
        runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.SockSite(runner, listening_socket("127.0.0.1", 0, handshake_tier))  # as the daemon listens
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30), "server did not start"
    engine.start()
    try:
        yield Served(engine, metrics, f"http://127.0.0.1:{holder['port']}", holder["port"], api)
    finally:
        engine.fail_all("test over")
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        engine.stop()
