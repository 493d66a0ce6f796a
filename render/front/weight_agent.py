"""HAProxy's agent-check, answered: a TCP port that writes the worker's weight and closes.

HAProxy (`agent-check agent-port P agent-inter 500ms` on a server line) connects every
agent-inter, reads one line and closes; a line such as `37%` sets the server's weight to that
percentage of its configured weight (HAProxy 2.6 configuration manual, "agent-check"). A failed
connection changes nothing there (the HTTP health check judges whether the worker is up), so a
worker that is gone keeps its last weight until its successor answers. The weight comes from
render/weight.py through the engine's snapshot; before the model has loaded (and once the engine
has stopped) it is full: readiness, not the weight, keeps such a worker out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from render.weight import FULL_PCT

log = logging.getLogger(__name__)

# A balancer that connects and never reads must not hold a connection open.
WRITE_TIMEOUT_S = 2.0


def agent_reply(percent: int) -> bytes:
    """The agent-check's answer: the weight alone (no `up`/`ready`, which would override the
    health check or an operator's drain)."""
    return f"{percent}%\n".encode()


class WeightAgent:
    """The listening socket; `weight()` (blocking: it asks the engine process) runs off the loop."""

    def __init__(self, weight: Callable[[], int]):
        self.weight = weight
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; the address bound (an ephemeral port resolved)."""
        self.server = await asyncio.start_server(self._answer, host, port, reuse_address=True)
        bound = self.server.sockets[0].getsockname()
        return bound[0], bound[1]

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                percent = await asyncio.get_running_loop().run_in_executor(None, self.weight)
            except Exception:  # noqa: BLE001 - the engine going away: full weight, readiness judges it
                log.debug("weight unknown; answering full", exc_info=True)
                percent = FULL_PCT
            writer.write(agent_reply(percent))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (TimeoutError, OSError):
            pass  # the balancer went away first: its next check asks again
        finally:
            writer.close()
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT_S)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
