"""What one agent owns, locked before it touches anything (turbonode.locks).

An agent owns its status socket and, unless it only observes (dry-run), every worker it throttles;
each is an flock on `<socket path>.lock`. The device it shapes is locked by the datapath itself
(tc.datapath.Datapath.hold, /run/turbonode/qos/<netns>/<dev>.lock), so two agents on different
sockets cannot both shape one device, nor `turboctl qos` change it under a running agent. A
second agent is refused with the first one's pid and has changed nothing. The kernel drops the
locks when an agent dies, kill -9 included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager

from turbonode.config import AgentConfig
from turbonode.locks import AGENT_ROLE, FileLock


def lock_path(socket_path: str) -> str:
    return os.path.abspath(socket_path) + ".lock"


def _refusal(what: str) -> Callable[[int | None, str], str]:
    return lambda pid, _role: f"another agent (pid {pid or '?'}) {what}"


@contextmanager
def owned(cfg: AgentConfig, worker_sockets: Iterable[str]) -> Iterator[None]:
    """Hold the agent's locks for the duration (its socket, each worker's); raises
    turbonode.locks.LockHeld naming the other agent if one already holds one of them."""
    wanted = [(cfg.socket, "is already serving {path}")]
    if not cfg.dry_run:  # a dry-run agent never throttles: it may watch workers another agent drives
        wanted += [(path, "already throttles the worker at {path}: one agent per worker") for path in worker_sockets]
    with ExitStack() as stack:
        for path, what in wanted:
            lock = FileLock(lock_path(path))
            lock.acquire(AGENT_ROLE, _refusal(what.format(path=path)))
            stack.callback(lock.release)
        yield
