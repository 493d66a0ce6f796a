"""The pipes between the worker's front process and its engine process (render/engine_host.py).

Each pipe is a socketpair carrying pickled, length-framed messages (multiprocessing
Connection's framing). Messages are tuples whose first item says what they are:

  ("call", id, method, args)    front -> engine; answered by ("reply", id, ok, value)
  ("cast", method, args)        front -> engine; no answer (drop a job's pixels, stop)
  (event, ...)                  engine -> front; anything else: job ends, metrics, GC pauses

There are two pipes. The *link* (Link: one reader thread per side, `send` safe from any thread)
carries the start-up, the status calls, the throttle and the metrics. The *lane* carries what a
request waits for, submit and the job ends; on the front it is read and written by the event
loop itself (AsyncLink), so neither a reply nor a job's end waits for a reader thread to get
the GIL and then for the loop to get it back: under a GC storm in the front each of those
hand-offs can wait out a whole collection. A call waits for its reply (bounded); when the other
side goes away every waiting call fails with EngineGone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from turbonode.errors import TurbonodeError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a call the engine process leaves unanswered this long is an error
# multiprocessing Connection's frame (the engine's end of the lane is one): a signed 32-bit
# length, or -1 and then a 64-bit one, then the pickle
SHORT = struct.Struct("!i")
LONG = struct.Struct("!Q")


class EngineGone(TurbonodeError):
    """The engine process has exited (or its pipe closed)."""


class RemoteError(TurbonodeError):
    """A call failed in the engine process with an error the front does not know by type."""


def settle(future, ok: bool, value: Any) -> None:
    """Resolve a call's future (threaded or asyncio) with its reply; one given up on stays as it is."""
    if future is None or future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def frame(message: tuple) -> bytes:
    """`message` as a Connection on the other end receives it."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    head = SHORT.pack(n) if n <= 0x7FFFFFFF else SHORT.pack(-1) + LONG.pack(n)
    return head + payload


def unanswered(method: str, timeout: float) -> RemoteError:
    return RemoteError(f"the engine process did not answer {method} within {timeout:g} s")


def _expire(future: asyncio.Future, method: str, timeout: float) -> None:
    settle(future, False, unanswered(method, timeout))


class Frames:
    """Cuts a byte stream into the messages a Connection sent, whatever the chunks."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        buf = self._buf
        buf += data
        messages = []
        while len(buf) >= SHORT.size:
            (n,) = SHORT.unpack_from(buf)
            start = SHORT.size
            if n == -1:
                if len(buf) < SHORT.size + LONG.size:
                    break
                (n,) = LONG.unpack_from(buf, SHORT.size)
                start += LONG.size
            if len(buf) < start + n:
                break
            messages.append(pickle.loads(bytes(buf[start : start + n])))
            del buf[: start + n]
        return messages


class Link:
    def __init__(self, conn: Connection, on_message: Callable[[tuple], None], on_closed: Callable[[], None]):
        self.conn = conn
        self._on_message, self._on_closed = on_message, on_closed
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._pending_lock = threading.Lock()
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="turbonode-engine-link", daemon=True)

    def start(self) -> Link:
        self._reader.start()
        return self

    def send(self, message: tuple) -> None:
        if self.closed:
            raise EngineGone("the engine process has exited")
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError) as exc:
            raise EngineGone(f"the engine process has exited ({exc})") from None

    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run `method` in the engine process; its value, or the error it raised (see reply)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._pending_lock:
            if self.closed:
                raise EngineGone("the engine process has exited")
            self._pending[call_id] = future
        try:
            self.send(("call", call_id, method, args))
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise unanswered(method, timeout) from None
        finally:
            with self._pending_lock:
                self._pending.pop(call_id, None)

    def cast(self, method: str, *args: Any) -> None:
        self.send(("cast", method, args))

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "reply":
                    _, call_id, ok, value = message
                    with self._pending_lock:
                        future = self._pending.get(call_id)
                    settle(future, ok, value)
                else:
                    try:
                        self._on_message(message)
                    except Exception:  # noqa: BLE001 - one bad message must not stop the link
                        log.exception("handling %s from the other process failed", message[0])
        except (EOFError, OSError):
            pass
        self.close()
        self._on_closed()

    def close(self) -> None:
        with self._pending_lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():  # one its reply already settled stays as it is
            settle(future, False, EngineGone("the engine process has exited"))
        self.conn.close()


class AsyncLink(asyncio.Protocol):
    """The front's end of the lane, served by the event loop: use it from the loop's thread only."""

    def __init__(self, on_message: Callable[[tuple], None]):
        self._on_message = on_message
        self._frames = Frames()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.transport: asyncio.Transport | None = None
        self.closed = False

    @classmethod
    async def open(cls, sock: socket.socket, on_message: Callable[[tuple], None]) -> AsyncLink:
        """The lane on `sock`; the engine's exit is the link's to report (RemoteEngine._on_closed)."""
        _, link = await asyncio.get_running_loop().connect_accepted_socket(lambda: cls(on_message), sock)
        return link

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except Exception:  # noqa: BLE001 - a torn stream cannot be resynchronised: hang up
            log.exception("unreadable message on the engine lane")
            if self.transport is not None:
                self.transport.close()
            return
        for message in messages:
            if message[0] == "reply":
                _, call_id, ok, value = message
                settle(self._pending.get(call_id), ok, value)
                continue
            try:
                self._on_message(message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the lane
                log.exception("handling %s from the engine process failed", message[0])

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            settle(future, False, EngineGone("the engine process has exited"))

    async def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Like Link.call, awaited: the loop serves other requests meanwhile."""
        if self.closed or self.transport is None:
            raise EngineGone("the engine process has exited")
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future = self._pending[call_id] = loop.create_future()
        # a timer rather than wait_for: the reply then wakes the caller in one turn of the loop, not two
        timer = loop.call_later(timeout, _expire, future, method, timeout)
        try:
            self.transport.write(frame(("call", call_id, method, args)))
            return await future
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)
