"""What the worker's tests share (its front, engine and accounts folders, and tests elsewhere that run
a worker in this process): one tiny model of each family per process and a step loop; engines,
jobs and an in-process server; small clients of its HTTP API; and the worker daemon as a
subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import re
import threading

import psutil
import torch

from render.engine.backends.select import make_backend
from render.engine.encode_prompt import PromptEncoder
from render.engine.families.base import Denoising, Family
from render.engine.model import load_model
from render.engine.scheduler import Engine, EngineSettings
from render.engine.tiny import variants as tiny
from render.front.http_api import Api, listening_socket
from render.front.metrics import WorkerMetrics
from render.jobs import JobRequest, RequestDefaults
from tests.helpers import daemon_env, turboctl_argv
from tests.helpers import start as start_process

# ---- families -----------------------------------------------------------------------------------

SIZE = 64  # pixels: a 8x8 latent keeps each denoiser call a few ms on CPU
# what each family's tests render: the SD 1.x tiny, the three new tiny variants, and the
# variants only tests build (SD3 shipped without T5, guidance-distilled Flux-dev)
NAMES = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux")
EXTRA = {"tiny-sd3-no-t5": lambda: tiny.sd3(t5=False), "tiny-flux-dev": lambda: tiny.flux(guidance_embeds=True)}


@functools.cache
def family(name: str) -> Family:
    torch.set_num_threads(2)
    if name in EXTRA:
        from render.engine.families import family_for

        parts = EXTRA[name]()
        return family_for(parts.pipeline_class)(parts)
    return load_model(name)


def guidance_for(fam: Family) -> float:
    """A guidance that exercises the family's conditioning: CFG where it has it, the embedding on Flux-dev."""
    if fam.uses_cfg:
        return 5.0
    return 3.5 if fam.name == "flux" and fam.guidance_distilled else 0.0  # type: ignore[attr-defined]


def start(
    fam: Family,
    prompt: str = "a red cat",
    *,
    seed: int = 1,
    steps: int = 3,
    guidance: float | None = None,
    negative: str = "",
    size: int = SIZE,
    sampler: str | None = None,
    height: int | None = None,
) -> Denoising:
    guidance = guidance_for(fam) if guidance is None else guidance
    cond, uncond = fam.encode_prompts([prompt, negative])
    return fam.start(
        cond=cond,
        uncond=uncond,
        guidance=guidance,
        seed=seed,
        height=height or size,
        width=size,
        sampler=sampler or fam.defaults.sampler["relax"],
        steps=steps,
    )


def predictor(fam: Family):
    module = fam.denoiser_module()

    @torch.inference_mode()
    def predict(inputs):
        return module.call(inputs)

    return predict


def run(fam: Family, batch: list[Denoising]) -> int:
    """Step every unfinished image of `batch` together, one denoiser call per step; returns the calls."""
    predict, calls = predictor(fam), 0
    while live := [d for d in batch if not d.done]:
        fam.step(live, predict)
        calls += 1
    return calls


@torch.inference_mode()
def image(fam: Family, d: Denoising) -> torch.Tensor:
    """The decoded image in [0, 1], [3, H, W] (what a pipeline's output_type='pt' gives)."""
    return (fam.decoder_module()(fam.vae_input(d))[0] / 2 + 0.5).clamp(0, 1)


# ---- engines and an in-process server ------------------------------------------------------------


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


# ---- the HTTP API, as a client ---------------------------------------------------------------------


def post(url, body, headers=None, raw=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request(
        "POST", "/v1/images/generations", body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def get(url, path, method="GET"):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a text exposition (labels in any order), or 0 when absent."""
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).items():
            return float(m.group(2))
    return 0.0


def scrape(url: str) -> str:
    return get(url, "/metrics")[1].decode()


# ---- the worker daemon -------------------------------------------------------------------------------


def start_worker(tmp_path):
    """`turboctl worker run` (tiny model) as a daemon: the process, its URL, its control socket, its engine."""
    control = str(tmp_path / "worker.sock")
    argv = turboctl_argv("worker", "run", "--model", "tiny", "--listen", "127.0.0.1:0", "--control", control)
    proc, out = start_process(argv, daemon_env(TURBONODE_WORKER_DRAIN_TIMEOUT="5"), cwd=tmp_path)
    found = out.wait_for(r"serving (http://\S+)", 120)
    assert found, f"the worker did not start (status {proc.poll()}):\n{out.text}"
    engines = psutil.Process(proc.pid).children()
    assert len(engines) == 1, engines
    return proc, found.group(1), control, engines[0]


def kill_worker(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()
