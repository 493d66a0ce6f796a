"""The engine process: loads the model, runs the engine, and serves it to the front over a pipe.

The worker is two processes. The front (render/daemon.py) runs the HTTP API, the control
socket and the metrics; this one runs only the render loop (render/engine.py) and what it
needs. They share no GIL: a garbage-collection storm or a busy thread among the front's
request handlers cannot stall a denoising step here, and every GIL hand-back of the render
loop (each denoiser call, each boundary) waits only for this process's own few threads.

The front starts it (`ENTRY`, with `--fd N --lane-fd M`: one end of each of two socketpairs,
render/engine_link.py) and sends ("start", WorkerConfig, policy, log levels), and gets ("ready",
info) once the model is loaded, or ("failed", message). Then this process answers the front's
calls (the methods of Host below), and pushes events: ("status", stage) while it loads, ("done",
...) on the lane when a job ends, ("metric", name, args) for the front's WorkerMetrics, ("gc",
generation, pause_s) for each of its own collections. SIGINT and SIGTERM are ignored: the front
drains and then stops this process (Ctrl-C in a terminal signals the whole group); when the
front's end of the pipe closes, it exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from turbonode import logs
from turbonode.errors import TurbonodeError

from .cpu_threads import WAIT_POLICY_ENV, available_cpus, default_threads, wait_policy_default
from .engine_link import Link, RemoteError
from .jobs import JobState
from .png import encode_png

log = logging.getLogger(__name__)

ENTRY = "import sys; from render.engine_host import main; sys.exit(main())"  # python -c: `ps` shows what runs
# what the engine reports
METRIC_METHODS = frozenset({"observe_step", "observe_decode", "observe_stage", "job_finished"})
STOP_TIMEOUT_S = 10.0  # the engine thread's last boundary, at most


class MetricsRelay:
    """The engine's `metrics`: each observation travels to the front's WorkerMetrics."""

    def __init__(self, post):
        self._post = post

    def __getattr__(self, name: str):
        if name not in METRIC_METHODS:
            raise AttributeError(name)
        return lambda *args: self._post(("metric", name, args))


def pixels(job) -> list | None:
    """A done job's images while the engine still holds them, else None."""
    return [s.image for s in job.samples] if job.state is JobState.DONE and not job.images_dropped else None


def job_end(job, now: float) -> tuple:
    """What the front needs of a job that has ended: its final description and its pixels
    (PNG-encoded by the sender thread, off the engine loop and off the front's GIL)."""
    return ("done", job.id, job.state.value, job.error, job.finished, job.describe(now), pixels(job))


def encode_pixels(message: tuple) -> tuple:
    """A job end with its images as base64 PNGs, as the HTTP API answers them."""
    if message[0] != "done" or message[-1] is None:
        return message
    return (*message[:-1], [encode_png(image) for image in message[-1]])


def job_record(job, now: float, with_images: bool) -> dict:
    """A job as `job` answers: state, description, times, and the pixels when asked and held."""
    images = pixels(job) if with_images else None
    return {
        "id": job.id,
        "request": job.request,
        "state": job.state.value,
        "error": job.error,
        "created": job.created,
        "finished": job.finished,
        "images_dropped": job.images_dropped,
        "describe": job.describe(now),
        "images": None if images is None else [encode_png(image) for image in images],
    }


class Host:
    """The engine's side of the pipe: the calls the front makes, run in the reader thread."""

    def __init__(self, engine, post_end):
        self.engine = engine
        self.post_end = post_end  # the lane: the front's event loop reads job ends there

    def table(self) -> dict:
        e = self.engine
        return {
            "submit": self.submit,
            "job": self.job,
            "cancel": self.cancel,
            "drop_images": self.drop_images,
            "snapshot": e.snapshot,
            "tiers": e.jobs.tiers,
            "heartbeat": lambda: (e.alive, e.heartbeat),
            "unsupported_size": e.backend.unsupported_size,
            "throttle": self.throttle,
            "close_intake": e.close_intake,
            "wait_idle": e.wait_idle,
            "fail_all": e.fail_all,
        }

    def submit(self, request, keep_images: bool = True) -> dict:
        """Queue a job; its end goes to the front on the lane. keep_images=False: the front only
        delivers the pixels, so they are dropped here once the end (which holds them) is posted."""
        job = self.engine.submit(request)

        def ended(_future) -> None:
            self.post_end(job_end(job, self.engine.clock()))
            if not keep_images:
                job.drop_images()

        job.future.add_done_callback(ended)
        return {"id": job.id, "submitted": job.submitted, "created": job.created}

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


class Channel:
    """One pipe to the front: its Link (a reader thread) and one sender thread, so no engine
    thread ever blocks on the pipe or encodes a PNG."""

    def __init__(self, conn: Connection, on_message, on_closed):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.link = Link(conn, lambda message: on_message(self, message), on_closed)
        self.sender = threading.Thread(target=self.run_sender, name="turbonode-engine-sender", daemon=True)

    def post(self, message: tuple | None) -> None:
        """Queue a message for the front (any thread; never blocks on the pipe); None ends the sender."""
        self.outbox.put(message)

    def run_sender(self) -> None:
        while True:
            message = self.outbox.get()
            if message is None:
                return
            self.link.send(encode_pixels(message))

    def stop(self, timeout: float) -> None:
        self.post(None)
        self.sender.join(timeout)


class Server:
    """Reads the front's messages on both pipes (render/engine_link.py: the link and the lane);
    runs its calls and answers each on the pipe it came by; events go out by `post` (the link)
    and job ends by `lane.post`."""

    BLOCKING = frozenset({"wait_idle"})  # calls that wait: each in its own thread, so others go on

    def __init__(self, conn: Connection, lane: Connection | None = None):
        self.main = Channel(conn, self._on_message, self._on_closed)
        self.lane = Channel(lane, self._on_message, self._on_closed) if lane is not None else self.main
        self.channels = (self.main,) if lane is None else (self.main, self.lane)
        self.post = self.main.post
        self.methods: dict[str, Any] = {}
        self.stopped = threading.Event()

    def start_senders(self) -> None:
        for channel in self.channels:
            channel.sender.start()

    def start_readers(self) -> None:
        for channel in self.channels:
            channel.link.start()

    def stop_senders(self, timeout: float) -> None:
        for channel in self.channels:
            channel.stop(timeout)

    def _on_message(self, channel: Channel, message: tuple) -> None:
        kind = message[0]
        if kind == "call":
            _, call_id, method, args = message
            if method in self.BLOCKING:
                threading.Thread(target=self._answer, args=(channel, call_id, method, args), daemon=True).start()
            else:
                self._answer(channel, call_id, method, args)
        elif kind == "cast":
            _, method, args = message
            if method == "stop":
                self.stopped.set()
            else:
                self._run(method, args)

    def _run(self, method: str, args: tuple) -> Any:
        fn = self.methods.get(method)
        if fn is None:
            raise RemoteError(f"the engine process has no method {method!r} (yet)")
        return fn(*args)

    def _answer(self, channel: Channel, call_id: int, method: str, args: tuple) -> None:
        try:
            reply = ("reply", call_id, True, self._run(method, args))
        except TurbonodeError as exc:  # the project's own errors travel by type (Rejected, FamilyError...)
            reply = ("reply", call_id, False, exc)
        except Exception as exc:  # noqa: BLE001 - answered, not raised: the engine keeps serving
            log.exception("call %s failed", method)
            reply = ("reply", call_id, False, RemoteError(f"{method} failed: {type(exc).__name__}: {exc}"))
        channel.post(reply)

    def _on_closed(self) -> None:
        self.stopped.set()


def torch_threads(configured: int) -> int:
    """The intra-op threads to run (configured, or the default for the CPUs this worker may use),
    set for the loading thread too; the engine thread sets its own (render/engine.py)."""
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
    from .engine import Engine, EngineSettings
    from .http_api import RequestDefaults
    from .model import load_model

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


def stage(server: Server, what: str) -> None:
    log.info("%s", what)
    server.post(("status", what))


def serve(conn: Connection, lane: Connection) -> int:
    server = Server(conn, lane)
    server.start_senders()
    start = conn.recv()  # before the readers run: the first message is always the start
    _, cfg, policy, levels = start
    logs.setup(levels.get("", logging.WARNING))
    for name, level in levels.items():
        if name:
            logging.getLogger(name).setLevel(level)
    server.start_readers()
    from .gc_telemetry import GcMonitor, freeze_after_load

    try:
        engine, info = build(cfg, policy, MetricsRelay(server.post), lambda what: stage(server, what))
    except Exception as exc:  # noqa: BLE001 - the front reports it and exits, as a load error in one process did
        if not isinstance(exc, TurbonodeError):
            log.exception("loading the model failed")
        message = str(exc) if isinstance(exc, TurbonodeError) else f"{type(exc).__name__}: {exc}"
        server.post(("failed", message))
        server.stop_senders(STOP_TIMEOUT_S)
        return 1
    server.methods = Host(engine, server.lane.post).table()
    freeze_after_load()
    gc = GcMonitor(observe=lambda generation, pause: server.post(("gc", generation, pause))).install()
    engine.start()
    server.post(("ready", info))
    server.stopped.wait()
    engine.stop(STOP_TIMEOUT_S)
    gc.uninstall()
    server.stop_senders(STOP_TIMEOUT_S)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render.engine_host", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the link (a socketpair)")
    parser.add_argument("--lane-fd", type=int, required=True, help="this process's end of the lane (a socketpair)")
    args = parser.parse_args(argv)
    wait_policy_default()  # before torch loads: OpenMP reads it once
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    link, lane = (Connection(socket.socket(fileno=fd).detach()) for fd in (args.fd, args.lane_fd))
    return serve(link, lane)


def _die_with_parent() -> None:
    """SIGKILL this process when the front dies, however it dies (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed pipe still ends this process
    if os.getppid() == 1:  # the front died before prctl took effect
        sys.exit(1)
