"""The pipe between the worker's front process and its engine process (render/engine_host.py).

One duplex multiprocessing Connection (pickled, length-framed messages) over a socketpair.
Messages are tuples whose first item says what they are:

  ("call", id, method, args)    front -> engine; answered by ("reply", id, ok, value)
  ("cast", method, args)        front -> engine; no answer (drop a job's pixels, stop)
  (event, ...)                  engine -> front; anything else: job ends, metrics, GC pauses

Each side has one reader thread; `send` is safe from any thread. A call waits for its reply
(bounded); when the other side goes away every waiting call fails with EngineGone.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from turbonode.errors import TurbonodeError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a call the engine process leaves unanswered this long is an error


class EngineGone(TurbonodeError):
    """The engine process has exited (or its pipe closed)."""


class RemoteError(TurbonodeError):
    """A call failed in the engine process with an error the front does not know by type."""


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
            raise RemoteError(f"the engine process did not answer {method} within {timeout:g} s") from None
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
                    if future is not None:
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value)
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
        for future in pending.values():
            future.set_exception(EngineGone("the engine process has exited"))
        self.conn.close()
