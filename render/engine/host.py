"""The engine process: loads the model, runs the engine, and serves it to the front.

The worker is two processes. The front (render/front/daemon.py) runs the HTTP API, the control
socket and the metrics; this one runs only the render loop (render/engine/scheduler.py) and what it
needs. They share no GIL: a garbage-collection storm or a busy thread among the front's
request handlers cannot stall a denoising step here, and every GIL hand-back of the render
loop (each denoiser call, each boundary) waits only for this process's own few threads.

The front starts it (render/link.py `ENTRY`, with `--calls` and `--events`: the endpoints of
the two sockets) and casts start(WorkerConfig, policy, log levels); this process answers
ready once the model is loaded, or failed and then waits to be stopped. Then its main thread
answers the front's calls (Host below) until told to stop, and it posts events: its stages
while it loads, each job's end, the metrics for the front's WorkerMetrics, and each of its
own collections (every message is listed in render/link.py). SIGINT and SIGTERM are ignored:
the front drains and then stops this process (Ctrl-C in a terminal signals the whole group);
when the front dies, the kernel kills it (PDEATHSIG).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from render.cpu_threads import WAIT_POLICY_ENV, available_cpus, default_threads, wait_policy_default
from render.engine.answer import http_answer, receive_connection, write_answer
from render.gc_telemetry import GcMonitor, freeze_after_load
from render.jobs import JobState, RequestDefaults, images_answer, tier_headers
from render.link import METRICS, Call, Cast, EngineLink, Event, RemoteError, Server
from render.png import base64_png
from turbonode import logs
from turbonode.errors import TurbonodeError

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # the engine thread's last boundary, at most


class MetricsRelay:
    """The engine's `metrics`: each observation travels to the front's WorkerMetrics."""

    def __init__(self, post):
        self._post = post

    def __getattr__(self, name: str):
        if name not in METRICS:
            raise AttributeError(name)
        return lambda *args: self._post((Event.METRIC, name, args))


def pixels(job) -> list | None:
    """A done job's images while the engine still holds them, else None."""
    return [s.image for s in job.samples] if job.state is JobState.DONE and not job.images_dropped else None


def job_end(job, now: float) -> tuple:
    """What the front needs of a job that has ended: its final description and its pixels
    (PNG-encoded by the sender thread, off the engine loop and off the front's GIL)."""
    return (Event.DONE, job.id, job.state.value, job.error, job.finished, job.describe(now), pixels(job), False)


def answer_on(conn: socket.socket, job, clock: Callable[[], float]) -> tuple:
    """Write a done sync job's answer on the client's connection (render/engine/answer.py); its end,
    without pixels, for the front. The answer says how long it took to make (`answer_s`: the job's
    end to its PNGs encoded), the part of a client's first byte that neither the engine's steps nor
    the front account for."""
    pngs = [str(base64_png(s.image), "ascii") for s in job.samples]
    described = job.describe(clock())
    described["answer_s"] = round(clock() - job.finished, 4)
    write_answer(
        conn, http_answer(images_answer(job.created, pngs, job.request.prompt, described), tier_headers(job.request))
    )
    # answered even if the write failed: the front must not write after part of an answer
    return (Event.DONE, job.id, job.state.value, job.error, job.finished, described, None, True)


def images(arrays) -> list[pickle.PickleBuffer]:
    """Images as the HTTP API answers them (base64 PNGs), each to travel as a frame of its own."""
    return [pickle.PickleBuffer(base64_png(array)) for array in arrays]


def encode_pixels(message: tuple) -> tuple:
    """A job end with its images encoded (the sender thread's `prepare`)."""
    if message[0] != Event.DONE or message[6] is None:
        return message
    return (*message[:6], images(message[6]), *message[7:])


def job_record(job, now: float, with_images: bool) -> dict:
    """A job as `job` answers: state, description, times, and the pixels when asked and held."""
    held = pixels(job) if with_images else None
    return {
        "id": job.id,
        "request": job.request,
        "state": job.state.value,
        "error": job.error,
        "created": job.created,
        "finished": job.finished,
        "images_dropped": job.images_dropped,
        "describe": job.describe(now),
        "images": None if held is None else images(held),
    }


class Host:
    """The engine's side of the channel: the calls the front makes, run in the serving thread."""

    def __init__(self, engine, post, answers: socket.socket | None = None):
        self.engine = engine
        self.post = post
        self.answers = answers  # where the front sends the connections of sync jobs (None: it does not)

    def table(self) -> dict:
        e = self.engine
        return {
            Call.SUBMIT: self.submit,
            Call.JOB: self.job,
            Call.CANCEL: self.cancel,
            Call.SNAPSHOT: e.snapshot,
            Call.TIERS: e.jobs.tiers,
            Call.HEARTBEAT: lambda: (e.alive, e.heartbeat),
            Call.CLOSE_INTAKE: e.close_intake,
            Call.WAIT_IDLE: e.wait_idle,
            Call.FAIL_ALL: e.fail_all,
            Cast.DROP_IMAGES: self.drop_images,
            Cast.THROTTLE: self.throttle,
        }

    def submit(self, request, keep_images: bool = True, answer_here: bool = False) -> dict:
        """Queue a job; its end goes to the front when it comes. keep_images=False: the front only
        delivers the pixels, so they are dropped here once the end (which holds them) is posted.
        answer_here: the client's connection waits on the answers channel (taken first, whatever
        happens next); a done job's answer is written there, in a thread of its own."""
        if answer_here and self.answers is None:
            raise RemoteError("this engine process has no answers channel")
        conn = receive_connection(self.answers) if answer_here and self.answers is not None else None
        try:
            job = self.engine.submit(request)
        except BaseException:
            if conn is not None:
                conn.close()
            raise

        def end() -> None:
            if conn is not None and job.state is JobState.DONE:
                self.post(answer_on(conn, job, self.engine.clock))
            else:
                if conn is not None:
                    conn.close()  # failed or cancelled: the front answers that itself
                self.post(job_end(job, self.engine.clock()))
            if not keep_images:
                job.drop_images()

        def ended(_future) -> None:
            if conn is not None and job.state is JobState.DONE:  # PNGs and a write: not on the engine's loop
                threading.Thread(target=end, name="answer", daemon=True).start()
            else:
                end()

        job.future.add_done_callback(ended)
        described = job.describe(self.engine.clock())  # what an async request's 202 answers
        return {"id": job.id, "submitted": job.submitted, "created": job.created, "describe": described}

    def job(self, job_id: str, with_images: bool) -> dict | None:
        job = self.engine.get(job_id)
        return None if job is None else job_record(job, self.engine.clock(), with_images)

    def cancel(self, job_id: str) -> dict | None:
        job = self.engine.cancel(job_id)
        return None if job is None else job_record(job, self.engine.clock(), False)

    def drop_images(self, job_id: str) -> None:
        job = self.engine.get(job_id)
        if job is not None:
            job.drop_images()

    def throttle(self, throttle) -> None:
        """The front's throttle (None: released); expiry runs on the same monotonic clock here."""
        self.engine.throttle.adopt(throttle)
        self.engine.wake()


def torch_threads(configured: int) -> int:
    """The intra-op threads to run (configured, or the default for the CPUs this worker may use),
    set for the loading thread too; the engine thread sets its own (render/engine/scheduler.py)."""
    import torch

    n = configured or default_threads(available_cpus())
    torch.set_num_threads(n)
    return n


def build(cfg, policy, metrics, loading):
    """Load the model and build the engine, as the worker serves it; returns (engine, info).
    `loading(what)` reports each start-up stage (the front shows it in `systemctl status`)."""

    from .backends.select import make_backend
    from .backends.tensorrt import TensorRTOptions
    from .encode_prompt import PromptEncoder
    from .model import load_model
    from .scheduler import Engine, EngineSettings

    started = time.monotonic()
    loading(f"loading model {cfg.model}")
    threads = torch_threads(cfg.intra_op_threads)
    log.info("torch intra-op threads %d, OpenMP wait policy %s", threads, os.environ.get(WAIT_POLICY_ENV, "default"))
    family = load_model(cfg.model)
    log.info(
        "model %s loaded in %.1f s (%s family, %s)",
        family.model_id,
        time.monotonic() - started,
        family.name,
        family.fingerprint,
    )
    overrides: dict = {"intra_op_threads": threads}
    if policy is not None:
        overrides["policy"] = policy
    settings = EngineSettings.from_config(cfg, **overrides)
    settings.tier_defaults(family)  # a sampler the family cannot use fails here, before a backend is built
    started = time.monotonic()
    # tensorrt: a first start exports ONNX and builds engines (minutes; progress in the log)
    loading(f"preparing backend {cfg.backend} (device {cfg.device}) for model {family.model_id}")
    backend = make_backend(
        cfg.backend,
        family,
        cfg.device,
        tensorrt_options=TensorRTOptions.from_config(cfg, family.native_size),
        torch_graphs=cfg.torch_graphs,
    )
    size = cfg.size or family.native_size
    backend.prepare(size, size)
    backend_info = backend.describe()
    took = time.monotonic() - started
    log.info("backend %s on %s ready in %.1f s", backend_info["name"], backend_info["device"], took)
    encoder = PromptEncoder(family, backend.device, backend.dtype, cfg.text_cache_size)
    engine = Engine(backend, encoder, family, settings, metrics=metrics)
    defaults = RequestDefaults(
        size, engine.size_multiple, engine.defaults.steps, engine.defaults.guidance, size_check=backend.unsupported_size
    )
    info = {
        "backend": backend_info,
        "sizes": backend.sizes(),
        "family": family.name,
        "model": engine.describe_model(),
        "defaults": {
            "size": defaults.size,
            "size_multiple": defaults.size_multiple,
            "steps": dict(defaults.steps),
            "guidance": dict(defaults.guidance),
        },
    }
    return engine, info


def stage(link: EngineLink, what: str) -> None:
    log.info("%s", what)
    link.post((Event.STATUS, what))


def serve(calls: str, events: str, answers: socket.socket | None = None) -> int:
    link = EngineLink(calls, events, prepare=encode_pixels)
    server = Server(link)
    _, _, (cfg, policy, levels) = link.recv()  # the first message is always the start
    logs.setup(levels.get("", logging.WARNING))
    for name, level in levels.items():
        if name:
            logging.getLogger(name).setLevel(level)
    try:
        engine, info = build(cfg, policy, MetricsRelay(link.post), lambda what: stage(link, what))
    except Exception as exc:  # noqa: BLE001 - the front reports it and exits, as a load error in one process did
        if not isinstance(exc, TurbonodeError):
            log.exception("loading the model failed")
        message = str(exc) if isinstance(exc, TurbonodeError) else f"{type(exc).__name__}: {exc}"
        link.post((Event.FAILED, message))
        server.serve()  # until the front, having read why, stops this process
        link.close(STOP_TIMEOUT_S)
        return 1
    server.methods = Host(engine, link.post, answers).table()
    freeze_after_load()
    gc = GcMonitor(observe=lambda generation, pause: link.post((Event.GC, generation, pause))).install()
    engine.start()
    link.post((Event.READY, info))
    server.serve()
    engine.stop(STOP_TIMEOUT_S)
    gc.uninstall()
    link.close(STOP_TIMEOUT_S)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render.engine.host", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", required=True, help="the front's calls socket (render/link.py)")
    parser.add_argument("--events", required=True, help="the front's events socket")
    parser.add_argument("--answers", type=int, help="descriptor of the channel of sync jobs' connections")
    args = parser.parse_args(argv)
    wait_policy_default()  # before torch loads: OpenMP reads it once
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    answers = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=args.answers) if args.answers else None
    return serve(args.calls, args.events, answers)


def _die_with_parent() -> None:
    """SIGKILL this process when the front dies, however it dies (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the front died before prctl took effect
        sys.exit(1)
