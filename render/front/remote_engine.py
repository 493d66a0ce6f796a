"""The front's handle on the engine process: what the HTTP API, the control socket, the metrics
and the daemon use of an engine (render/engine/scheduler.py), served by render/engine/host.py.

The throttle lives here, in the front, where the control socket sets it; each change is
pushed to the engine process, which expires it on the same monotonic clock. Jobs live in the
engine process: `enqueue` (awaited on the event loop) returns a RemoteJob whose end resolves
when the engine posts it (with its pixels); `get` and `cancel` ask the engine. Everything the
engine sends is read on the event loop (render/link.py), and so is its exit (a pidfd):
waiting callers see JobFailed or EngineGone, and `on_exit` tells the daemon, which then exits
so that its service manager restarts the worker. Calls from other threads wait for their answer
there; the event loop itself never waits for the engine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from render.jobs import JobCancelled, JobFailed, JobRequest, JobState
from render.link import ENTRY, METRICS, Call, Cast, EngineGone, Event, FrontLink, settle
from render.memory_lock import MemoryLock
from render.throttle import ThrottleState
from turbonode import sdnotify
from turbonode.errors import TurbonodeError

log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0  # the engine's last boundary and exit, before it is killed
UNCLAIMED_KEPT = 64  # job ends the front has not matched to a submit yet (a burst of instant failures)
LOG_LEVELS = ("", "render", "turbonode")  # loggers whose levels the engine process takes from the front


class EngineLoadError(TurbonodeError):
    """The engine process could not load the model or build the engine."""


@dataclass
class Picture:
    png: str  # base64, encoded in the engine process


class RemoteJob:
    """A job as the front sees it: its request and identity, what the engine last said of it, and
    its end once posted. Its end and `ended` happen on the event loop."""

    def __init__(
        self,
        engine: RemoteEngine,
        request: JobRequest,
        job_id: str,
        submitted: float,
        created: float,
        described: dict,
        kept: bool = True,
    ):
        self.engine, self.request, self.id = engine, request, job_id
        self.submitted, self.created = submitted, created
        self.kept = kept  # the engine holds the pixels until told (False: it dropped them once sent)
        self.state = JobState.QUEUED  # until the end arrives
        self.error: str | None = None
        self.finished: float | None = None
        self.images_dropped = False
        self.answered = False  # the engine process wrote its answer on the client's connection
        self.samples: list[Picture] = []
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._waiters: list[asyncio.Future] = []  # ended(): event-loop futures of the end
        self.latest = described  # the engine's description at submit, or at the last lookup
        self._final: dict | None = None

    @classmethod
    def from_record(cls, engine: RemoteEngine, record: dict) -> RemoteJob:
        job = cls(engine, record["request"], record["id"], 0.0, record["created"], record["describe"])
        job._end(record["state"], record["error"], record["finished"], record["describe"], record["images"])
        job.images_dropped = record["images_dropped"]
        return job

    @property
    def tier(self) -> str:
        return self.request.tier

    def _end(
        self, state: str, error: str | None, finished: float | None, described: dict, images, answered: bool = False
    ) -> None:
        self.state, self.error, self.finished = JobState(state), error, finished
        self.answered = answered
        if self.state.terminal:
            self._final = described
        self.samples = [Picture(str(png, "ascii")) for png in images or ()]
        if not self.state.terminal or self.future.done():
            return
        if self.state is JobState.DONE:
            self.future.set_result(self)
        elif self.state is JobState.CANCELLED:
            self.future.set_exception(JobCancelled(error or "cancelled"))
        else:
            self.future.set_exception(JobFailed(error or "failed"))
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            self._settle(waiter)

    def ended(self) -> asyncio.Future:
        """This job's end, awaitable on the running loop; cancelling the wait leaves the job alone.
        An end read off the channel wakes it in the same turn of the loop."""
        waiter = asyncio.get_running_loop().create_future()
        if self.future.done():
            self._settle(waiter)
        else:
            self._waiters.append(waiter)
        return waiter

    def _settle(self, waiter: asyncio.Future) -> None:
        exc = self.future.exception()  # a waiter whose request went away stays cancelled
        settle(waiter, exc is None, self if exc is None else exc)

    def lost(self, message: str, now: float) -> None:
        """The engine process exited before this job ended: it failed, and says why."""
        described = {
            "id": self.id,
            "object": "image.generation.job",
            "state": JobState.FAILED.value,
            "tier": self.tier,
            "created": int(self.created),
            "elapsed_s": round(now - self.submitted, 4),
            "error": message,
        }
        self._end(JobState.FAILED.value, message, now, described, None)

    def describe(self, now: float) -> dict:
        """As the engine described it last (get and cancel ask it again), or at its end."""
        out = dict(self._final if self._final is not None else self.latest)
        if self.images_dropped:
            out["images"] = "delivered or expired; no longer held"
        return out

    def drop_images(self) -> None:
        """Delivered: free the pixels here and in the engine (unless it has already)."""
        self.samples = []
        self.images_dropped = True
        if self.kept:
            with contextlib.suppress(EngineGone):  # gone: so are its pixels
                self.engine.link.cast(Cast.DROP_IMAGES, self.id)


class JobsView:
    """The engine's job table, as the readiness checks and the control socket read it (threads)."""

    def __init__(self, link: FrontLink):
        self._link = link

    def tiers(self, now: float) -> dict:
        return self._link.call_sync(Call.TIERS, now)


class BackendView:
    """What the front knows of the backend: its description (fixed once loaded)."""

    def __init__(self, info: dict):
        self.info = info

    def describe(self) -> dict:
        return dict(self.info)


class RemoteEngine:
    """Made on the front's event loop, in its main thread (the engine's death signal follows the
    thread that started it)."""

    clock = staticmethod(time.monotonic)  # CLOCK_MONOTONIC: the same clock in both processes
    wall = staticmethod(time.time)

    def __init__(self, on_exit: Callable[[], None] | None = None):
        self.throttle = ThrottleState(clock=self.clock, wall=self.wall)
        self.front_memory_lock = MemoryLock("front")  # the engine process has its own
        self.on_exit = on_exit
        self.accepting = True
        self.info: dict = {}
        self.metrics: Any = None  # the front's WorkerMetrics: the engine's observations land there
        self.gc: Any = None  # the front's GcMonitor: the engine's collections join the front's
        self._jobs: dict[str, RemoteJob] = {}  # live jobs, until the engine posts their end
        # ends posted before the submit's answer was read (a job failed at once): claimed by submit
        self._unclaimed: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._push_lock = threading.Lock()
        self._lost: str | None = None  # why jobs fail from now on: the engine process has exited
        self._loaded: concurrent.futures.Future[dict] = concurrent.futures.Future()
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.link = FrontLink(self._on_message)
        # systemd hears only the front (the main PID); the engine posts its stages instead
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout, first
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        calls, events = self.link.endpoints
        # sync jobs' connections go to the engine process over this pair (render/engine/answer.py);
        # non-blocking here: a full channel means answering the old way, never a blocked loop
        self._answers, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._answers.setblocking(False)
        argv = ["--calls", calls, "--events", events, "--answers", str(theirs.fileno())]
        with theirs:
            self.process = subprocess.Popen([sys.executable, "-c", ENTRY, *argv], env=env, pass_fds=(theirs.fileno(),))
        self.pid = self.process.pid
        self._pidfd = os.pidfd_open(self.pid)  # readable once the process has exited
        loop.add_reader(self._pidfd, self._exit)
        self.jobs = JobsView(self.link)
        self.backend: BackendView = BackendView({})
        self.sizes = None  # what the backend renders (render/engine/backends/sizes.py), once loaded

    # ---- start-up ---------------------------------------------------------------------

    def load(self, cfg, policy=None) -> dict:
        """Have the engine process load `cfg.model` (blocks for the whole load, in a thread); what it serves."""
        levels = {name: logging.getLogger(name).level for name in LOG_LEVELS}
        self.link.cast(Cast.START, cfg, policy, levels)
        self.info = self._loaded.result()
        self.backend = BackendView(self.info["backend"])
        self.sizes = self.info["sizes"]
        return self.info

    def describe_model(self) -> dict:
        return dict(self.info["model"])

    def unsupported_size(self, height: int, width: int) -> str | None:
        return None if self.sizes is None else self.sizes.unsupported(height, width)

    # ---- from the engine process (on the event loop) ----------------------------------

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == Event.DONE:
            job_id = message[1]
            job = self._jobs.pop(job_id, None)
            if job is not None:
                job._end(*message[2:])
            else:
                self._unclaimed[job_id] = message
                while len(self._unclaimed) > UNCLAIMED_KEPT:
                    self._unclaimed.popitem(last=False)
        elif kind == Event.METRIC:
            _, name, args = message
            if self.metrics is not None and name in METRICS:
                getattr(self.metrics, name)(*args)
        elif kind == Event.GC:
            if self.gc is not None:
                self.gc.record(message[1], message[2])
        elif kind == Event.STATUS:
            sdnotify.notify(f"STATUS={message[1]}")
        elif kind == Event.READY:
            self._loaded.set_result(message[1])
        elif kind == Event.FAILED:
            self._loaded.set_exception(EngineLoadError(message[1]))

    def _exit(self) -> None:
        """The engine process has exited: every waiting call and job fails, and the daemon hears."""
        if self.exited.done():
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        code = self.process.wait()
        self._lost = f"the engine process exited (status {code})"
        self._answers.close()
        self.link.close(EngineGone(self._lost))  # what it sent before is read first
        if not self._loaded.done():
            self._loaded.set_exception(EngineLoadError(f"the engine process exited while loading (status {code})"))
        jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.lost(self._lost, self.clock())
        self.exited.set_result(code)
        if self.on_exit is not None:
            self.on_exit()

    # ---- jobs -------------------------------------------------------------------------

    async def enqueue(self, request: JobRequest, keep_images: bool = True, answer_on=None) -> RemoteJob:
        """Queue a job; raises Draining, TierShed or QueueFull (all Rejected) when it cannot.
        keep_images=False: the answer waits for it (a sync request), so the engine drops the
        pixels once it has sent them, and delivering them needs no further message. answer_on:
        the client's connection, on which the engine process answers a done job itself (then
        `answered`); sent just before the submit, in the same turn of the loop, so the engine
        takes the connections in the order of the submits."""
        answer_here = answer_on is not None and self._hand_over(answer_on)
        made = await self.link.call(Call.SUBMIT, request, keep_images, answer_here)
        job = RemoteJob(self, request, made["id"], made["submitted"], made["created"], made["describe"], keep_images)
        ended = self._unclaimed.pop(job.id, None)
        if ended is not None:
            job._end(*ended[2:])
        elif self._lost is not None:  # accepted just before the engine died: no end will come
            job.lost(self._lost, self.clock())
        else:
            self._jobs[job.id] = job
        return job

    def _hand_over(self, conn) -> bool:
        try:
            socket.send_fds(self._answers, [b"c"], [conn.fileno()])
        except OSError as exc:  # full (the engine is not reading) or gone: the front answers
            log.warning("a sync job's connection was not handed to the engine process: %s", exc)
            return False
        return True

    def get(self, job_id: str) -> RemoteJob | None:
        """The job as the engine has it now (in a thread): a live one's description is refreshed."""
        live = self._jobs.get(job_id)
        record = self.link.call_sync(Call.JOB, job_id, live is None)
        return self._found(live, record)

    def cancel(self, job_id: str) -> RemoteJob | None:
        live = self._jobs.get(job_id)
        return self._found(live, self.link.call_sync(Call.CANCEL, job_id))

    def _found(self, live: RemoteJob | None, record: dict | None) -> RemoteJob | None:
        if record is None:
            return live  # ended and forgotten by the engine meanwhile, or never known
        if live is None:
            return RemoteJob.from_record(self, record)
        live.latest = record["describe"]
        return live

    # ---- status -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        return self.link.call_sync(Call.SNAPSHOT)

    @property
    def alive(self) -> bool:
        """The engine process runs (cheap: readiness asks on every request)."""
        return self.process.poll() is None and self.link.closed is None

    @property
    def heartbeat(self) -> float:
        """When the engine loop last came round; never, once its thread has died or the process gone."""
        try:
            turning, at = self.link.call_sync(Call.HEARTBEAT)
        except TurbonodeError:
            return float("-inf")
        return at if turning else float("-inf")

    def wake(self) -> None:
        """The throttle changed: the engine process takes the new one and re-plans."""
        with self._push_lock:  # read and sent together: two changes at once arrive in order
            self.link.cast(Cast.THROTTLE, self.throttle.current())
        self.keep_memory_lock()

    def keep_memory_lock(self) -> None:
        """Lock or unlock the front's pages as the throttle says (also once it has expired: the
        daemon calls this every MemoryLock.PERIOD_S)."""
        t = self.throttle.current()
        self.front_memory_lock.apply(t is not None and t.lock_memory)

    # ---- draining and stop (on the event loop) ----------------------------------------

    async def close_intake(self) -> tuple[int, int]:
        self.accepting = False
        return await self.link.call(Call.CLOSE_INTAKE)

    async def wait_idle(self, timeout: float) -> bool:
        return await self.link.call(Call.WAIT_IDLE, timeout, timeout=timeout + 5)

    async def fail_all(self, message: str) -> int:
        return await self.link.call(Call.FAIL_ALL, message)

    async def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Let the engine loop finish its boundary and exit; kill it after `timeout`, or at once
        while it loads (a load cannot be interrupted, and nothing runs yet to finish)."""
        if not self.exited.done():
            if not self._loaded.done():
                log.info("stopping the engine process while it loads the model")
                self.process.kill()
            else:
                with contextlib.suppress(EngineGone):
                    self.link.cast(Cast.STOP)
                try:
                    await asyncio.wait_for(asyncio.shield(self.exited), timeout)
                except TimeoutError:
                    log.warning("the engine process did not stop within %g s: killing it", timeout)
                    self.process.kill()
        if not self.exited.done():
            self.process.wait()
            self._exit()
