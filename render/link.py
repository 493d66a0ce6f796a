"""The link between the worker's front process (render/front/) and its engine process
(render/engine/host.py): the messages between them, in one list (Call, Cast, Event below), and
the channel they travel on, ZeroMQ as vLLM V1's API server and engine core talk: two sockets,
one direction each.

  calls   front PUSH -> engine PULL   ("call", id, method, args), answered by ("reply", id, ok, value);
                                      ("cast", method, args), not answered (start, throttle, stop ...)
  events  engine PUSH -> front PULL   the replies, and every other message the engine sends:
                                      ("done", ...) job ends, ("metric", ...), ("gc", ...), load stages

A message is a pickled tuple (pickle, not msgspec: docs/worker.md says why). Images are pickle
protocol 5 out-of-band buffers (`pickle.PickleBuffer`): each travels as a frame of its own,
never copied into the pickle, and pyzmq sends a large frame without copying it.

The front binds both sockets in a private directory (mkdtemp: mode 0700, so only its user and
root can connect) and removes it once the engine has answered, when both are connected: nothing
else can connect later and a killed front leaves nothing behind. Its end (FrontLink) lives on
its event loop, which reads the events socket itself whenever it is readable: neither a reply
nor a job's end waits for a reader thread to get the GIL and then for the loop to get it back
(under a GC storm in the front, each of those hand-offs can wait out a whole collection).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import pickle
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio

from turbonode.errors import TurbonodeError

log = logging.getLogger(__name__)

# How the front starts the engine process (python -c: `ps` shows what runs), with --calls and --events.
ENTRY = "import sys; from render.engine.host import main; sys.exit(main())"


class Call:
    """The front's calls, each answered ("reply", id, ok, value): render/engine/host.py's Host runs
    them, render/front/remote_engine.py makes them."""

    # (request, keep_images, answer_here) -> the job's id, times and description; answer_here: the
    # client's connection came first on the answers channel, and the engine answers on it (sync jobs)
    SUBMIT = "submit"
    JOB = "job"  # (job_id, with_images) -> the job's record, or None
    CANCEL = "cancel"  # (job_id) -> the job's record, or None
    SNAPSHOT = "snapshot"  # () -> the engine's snapshot (status, pace, backlog)
    TIERS = "tiers"  # (now) -> each tier's queue
    HEARTBEAT = "heartbeat"  # () -> (alive, when the loop last came round)
    CLOSE_INTAKE = "close_intake"  # () -> (queued, running) when intake closed
    WAIT_IDLE = "wait_idle"  # (timeout) -> whether it went idle; blocks: served in a thread of its own
    FAIL_ALL = "fail_all"  # (message) -> jobs failed


class Cast:
    """The front's messages that nobody answers."""

    START = "start"  # (WorkerConfig, policy, log levels): always the first
    THROTTLE = "throttle"  # (Throttle or None): the throttle in force
    DROP_IMAGES = "drop_images"  # (job_id): delivered, free the pixels
    STOP = "stop"  # (): leave the serving loop


class Event:
    """What the engine sends the front."""

    REPLY = "reply"  # (id, ok, value): a call's answer
    # (id, state, error, finished, description, images, answered): a job's end; answered: the engine
    # wrote the answer on the client's connection itself (render/engine/answer.py)
    DONE = "done"
    METRIC = "metric"  # (name, args): one of METRICS, for the front's WorkerMetrics
    GC = "gc"  # (generation, pause_s): one of the engine's collections
    STATUS = "status"  # (stage): a start-up stage, for systemd's STATUS=
    READY = "ready"  # (info): the model is loaded, the engine runs
    FAILED = "failed"  # (message): loading failed; the engine waits for stop


# The engine's observations (its `metrics`), relayed as ("metric", name, args) to the front's WorkerMetrics.
METRICS = frozenset({"observe_step", "observe_decode", "observe_stage", "job_finished"})
# Calls that wait for something: each is served in a thread of its own, so that the others go on.
BLOCKING = frozenset({Call.WAIT_IDLE})

CALL_TIMEOUT_S = 10.0  # a call the engine process leaves unanswered this long is an error
LINGER_MS = 2000  # the engine's last messages (a load error, job ends) get this long to leave at its exit


class EngineGone(TurbonodeError):
    """The engine process has exited."""


class RemoteError(TurbonodeError):
    """A call failed in the engine process with an error the front does not know by type."""


def pack(message: tuple) -> list:
    """`message` as frames: the pickle, then each PickleBuffer in it (an image) as it is."""
    frames: list = []
    head = pickle.dumps(message, protocol=5, buffer_callback=frames.append)
    return [head, *frames]


def unpack(frames: list) -> tuple:
    return pickle.loads(frames[0], buffers=frames[1:])


def settle(future, ok: bool, value: Any) -> None:
    """Resolve a call's future (threaded or asyncio) with its reply; one given up on stays as it is."""
    if future is None or future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def unanswered(method: str, timeout: float) -> RemoteError:
    return RemoteError(f"the engine process did not answer {method} within {timeout:g} s")


def _expire(future: asyncio.Future, method: str, timeout: float) -> None:
    settle(future, False, unanswered(method, timeout))


class FrontLink:
    """The front's end, on the running event loop. `call` from the loop; `call_sync` and `cast`
    from any other thread too (the loop sends for them). The loop reads what the engine sends:
    replies settle their calls, anything else goes to `on_event`, in the loop's thread."""

    def __init__(self, on_event: Callable[[tuple], None]):
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._on_event = on_event
        self._dir: str | None = tempfile.mkdtemp(prefix="turbonode-engine-")
        self._ctx = zmq.asyncio.Context()
        self._calls = self._ctx.socket(zmq.PUSH)  # an awaitable send: it waits for the engine to connect
        # read by the loop's reader below, not through zmq.asyncio's futures: a future's result
        # reaches its awaiter one turn of the loop later (a GIL release more per message)
        self._events = zmq.Socket(self._ctx, zmq.PULL)
        self.endpoints: list[str] = []
        for sock, name in ((self._calls, "calls"), (self._events, "events")):
            sock.linger = 0
            sock.bind(f"ipc://{self._dir}/{name}")
            self.endpoints.append(sock.get_string(zmq.LAST_ENDPOINT))
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future | concurrent.futures.Future] = {}
        self.closed: EngineGone | None = None  # why every call fails from now on
        self._loop.add_reader(self._events.FD, self._read)

    def _read(self) -> None:
        """Take every message waiting (the socket's FD only says that something changed)."""
        while self.closed is None and cast(int, self._events.get(zmq.EVENTS)) & zmq.POLLIN:
            frames = self._events.recv_multipart(zmq.NOBLOCK, copy=False)
            if self._dir is not None:  # the engine sends once it has both ends: let nobody else in
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            try:
                message = unpack(frames)
                if message[0] == Event.REPLY:
                    _, call_id, ok, value = message
                    settle(self._pending.pop(call_id, None), ok, value)
                else:
                    self._on_event(message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the link
                log.exception("a message from the engine process failed")

    def _send(self, message: tuple) -> None:
        """On the loop: queued in order by zmq.asyncio until the engine can take it."""
        if self.closed is not None:
            raise self.closed
        self._calls.send_multipart(pack(message), copy=False)

    def _request(self, call_id: int, method: str, args: tuple, future) -> None:
        try:
            self._send(("call", call_id, method, args))
        except EngineGone as exc:
            settle(future, False, exc)
            return
        self._pending[call_id] = future

    async def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run `method` in the engine process; its value, or the error it raised (travelling by
        type when it is one of the project's own, else RemoteError). Waits at most `timeout`."""
        future = self._loop.create_future()
        call_id = next(self._ids)
        # a timer rather than wait_for: the reply then wakes the caller in one turn of the loop, not two
        timer = self._loop.call_later(timeout, _expire, future, method, timeout)
        self._request(call_id, method, args, future)
        try:
            return await future
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)

    def call_sync(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """`call`, from a thread other than the loop's (the loop would wait for itself)."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(f"a blocking call of {method} on the event loop that would answer it")
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        self._threadsafe(self._request, call_id, method, args, future)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise unanswered(method, timeout) from None
        finally:
            self._pending.pop(call_id, None)

    def cast(self, method: str, *args: Any) -> None:
        """Send without waiting for an answer, from any thread; in order with the others."""
        if threading.get_ident() == self._loop_thread:
            self._send(("cast", method, args))
        else:
            self._threadsafe(self._send, ("cast", method, args))

    def _threadsafe(self, fn: Callable[..., None], *args: Any) -> None:
        if self.closed is not None:
            raise self.closed
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: so has the front
            raise EngineGone("the front's event loop has stopped") from None

    def close(self, why: EngineGone) -> None:
        """The engine has gone (on the loop): read what it sent before, then fail every call."""
        if self.closed is not None:
            return
        self._read()
        self.closed = why
        self._loop.remove_reader(self._events.FD)
        for future in list(self._pending.values()):  # one its reply already settled stays as it is
            settle(future, False, why)
        self._pending.clear()
        self._calls.close()
        self._events.close()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class EngineLink:
    """The engine's end: `recv` for the one thread that serves the front's calls; `post` from any
    thread (one sender thread owns the events socket and runs `prepare` on each message, so no
    engine thread blocks on the socket or encodes a PNG)."""

    def __init__(self, calls: str, events: str, prepare: Callable[[tuple], tuple] = lambda m: m):
        self._ctx = zmq.Context()
        self._calls = self._ctx.socket(zmq.PULL)
        self._calls.linger = 0
        self._calls.connect(calls)
        self._events = self._ctx.socket(zmq.PUSH)
        self._events.linger = LINGER_MS
        self._events.connect(events)
        self._prepare = prepare
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="turbonode-engine-sender", daemon=True)
        self._sender.start()

    def recv(self) -> tuple:
        """The front's next call or cast (blocks)."""
        return unpack(self._calls.recv_multipart(copy=False))

    def post(self, message: tuple | None) -> None:
        """Queue a message for the front (any thread; never blocks)."""
        self._outbox.put(message)

    def _send_all(self) -> None:
        while (message := self._outbox.get()) is not None:
            self._events.send_multipart(pack(self._prepare(message)), copy=False)
        self._events.close()  # its last messages leave within LINGER_MS (the context's term waits)

    def close(self, timeout: float) -> None:
        """Send what is queued, then close (the last messages get LINGER_MS to leave)."""
        self.post(None)
        self._sender.join(timeout)
        self._calls.close()
        if not self._sender.is_alive():  # else it is stuck on a front that does not read: just exit
            self._ctx.term()


class Server:
    """The engine's server: runs the front's calls and casts (its `methods`, by name) in the thread
    that calls `serve`; each answer goes out by the link's sender thread."""

    def __init__(self, link: EngineLink):
        self.link = link
        self.methods: dict[str, Any] = {}

    def serve(self) -> None:
        """Until the front casts stop."""
        while True:
            kind, *message = self.link.recv()
            if kind == "call":
                call_id, method, args = message
                if method in BLOCKING:
                    threading.Thread(target=self._answer, args=(call_id, method, args), daemon=True).start()
                else:
                    self._answer(call_id, method, args)
            elif kind == "cast":
                method, args = message
                if method == Cast.STOP:
                    return
                try:
                    self._run(method, args)
                except Exception:  # noqa: BLE001 - nobody waits for a cast's answer: logged
                    log.exception("cast %s failed", method)

    def _run(self, method: str, args: tuple) -> Any:
        fn = self.methods.get(method)
        if fn is None:
            raise RemoteError(f"the engine process has no method {method!r} (yet)")
        return fn(*args)

    def _answer(self, call_id: int, method: str, args: tuple) -> None:
        try:
            reply = (Event.REPLY, call_id, True, self._run(method, args))
        except TurbonodeError as exc:  # the project's own errors travel by type (Rejected, FamilyError...)
            reply = (Event.REPLY, call_id, False, exc)
        except Exception as exc:  # noqa: BLE001 - answered, not raised: the engine keeps serving
            log.exception("call %s failed", method)
            reply = (Event.REPLY, call_id, False, RemoteError(f"{method} failed: {type(exc).__name__}: {exc}"))
        self.link.post(reply)
