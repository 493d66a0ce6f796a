"""A real Redis for tests and benchmarks (Debian's redis-server): on a loopback port or a Unix
socket in a temporary directory, append-only with every write synced (so a restart after
kill -9 keeps every counter it acknowledged, as the ledger's deployment asks:
docs/worker.md, "Accounts"), stopped by its PID and removed afterwards.

    with RedisServer() as redis:        # redis.url: redis://127.0.0.1:PORT/0
        redis.kill()                    # SIGKILL, mid-run
        redis.start()                   # the same port, directory and data
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .interrupt import Closing

REDIS_SERVER = "redis-server"
REDIS_SKIP = None if shutil.which(REDIS_SERVER) else "redis-server not installed (Debian package redis-server)"
START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer(Closing):
    def __init__(self, unix_socket: bool = False):
        self.dir = Path(tempfile.mkdtemp(prefix="tn-redis-"))
        self.unix = self.dir / "redis.sock" if unix_socket else None
        self.port = 0 if unix_socket else free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.unix}" if self.unix else f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"]
        argv += ["--logfile", str(self.dir / "redis.log")]
        if self.unix:
            argv += ["--unixsocket", str(self.unix), "--unixsocketperm", "700"]
        quiet = subprocess.DEVNULL  # it logs to --logfile
        self.proc = subprocess.Popen(argv, stdin=quiet, stdout=quiet, stderr=quiet)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {self.log()[-1000:]}")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        try:
            family = socket.AF_UNIX if self.unix else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(str(self.unix) if self.unix else ("127.0.0.1", self.port))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL by PID, as a crash would end it; its data stays for the next start."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
