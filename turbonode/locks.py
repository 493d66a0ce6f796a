"""Ownership locks: flock(2) on a small file that names its holder ("PID ROLE").

The kernel drops a flock when its holder dies, kill -9 included, so a crash never leaves a
resource owned. The holder unlinks the file when it lets go (nothing stays behind in /run);
acquire() therefore re-checks, once it holds the lock, that the file it locked is still the one
at the path, and starts over if somebody unlinked it in between.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable

from .errors import TurbonodeError

POLL_S = 0.05
AGENT_ROLE = "agent"  # the role of a lock held for a whole life (the agent's), as opposed to one change


class LockHeld(TurbonodeError):
    """Another live process holds the lock."""

    def __init__(self, message: str, pid: int | None, role: str):
        super().__init__(message)
        self.pid = pid
        self.role = role


def parse_holder(text: str) -> tuple[int | None, str]:
    pid, _, role = text.strip().partition(" ")
    return (int(pid) if pid.isdigit() else None), role


class FileLock:
    """An exclusive lock on `path`, held from acquire() until release() or the process's death."""

    def __init__(self, path: str, remove_dir: bool = False):
        """`remove_dir`: the lock's directory is its own (created for it), removed once empty."""
        self.path = path
        self.remove_dir = remove_dir
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> tuple[int | None, str]:
        """(pid, role) the current holder wrote, (None, "") if unknown."""
        try:
            with open(self.path) as f:
                return parse_holder(f.read(200))
        except OSError:
            return None, ""

    def _open(self) -> int:
        for _ in range(3):
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # the holder of a sibling removed the emptied directory in between
            except OSError as exc:
                raise TurbonodeError(f"cannot create the lock file {self.path}: {exc.strerror or exc}") from None
        raise TurbonodeError(f"cannot create the lock file {self.path}: its directory keeps disappearing")

    def acquire(
        self,
        role: str,
        describe: Callable[[int | None, str], str],
        wait_s: float = 0.0,
        wait_for: Callable[[str], bool] = lambda role: True,
    ) -> None:
        """Take the lock. If another process holds it, retry for up to `wait_s` seconds while
        `wait_for(its role)` says its hold is a short one; then raise LockHeld with
        describe(pid, role) as the message."""
        deadline = time.monotonic() + wait_s
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                pid, other = self.holder()
                if time.monotonic() >= deadline or not wait_for(other):
                    raise LockHeld(describe(pid, other), pid, other) from None
                time.sleep(POLL_S)
                continue
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder unlinked it while we waited: lock the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {role}\n".encode())
            self._fd = fd
            return

    def release(self) -> None:
        """Unlink the file and let go (a waiter then re-opens the path); with `remove_dir`,
        remove the directory too if that left it empty: nothing stays behind."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        if self.remove_dir:
            try:
                os.rmdir(os.path.dirname(os.path.abspath(self.path)))
            except OSError:
                pass  # another interface's lock is still there
