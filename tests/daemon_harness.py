"""Start turboctl daemons as real subprocesses the way systemd would, and listen to them.

Used by tests/test_service_*.py: a NOTIFY_SOCKET datagram socket in a temp directory stands in
for systemd's, and promtool checks what the daemons serve on /metrics.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class NotifyListener:
    """systemd's side of sd_notify: a thread reads NOTIFY_SOCKET promptly, as systemd does
    (an unread socket fills after net.unix.max_dgram_qlen datagrams)."""

    def __init__(self, directory: Path):
        self.path = str(directory / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.extend(line for line in data.split("\n") if line)

    def wait_for(self, message: str, timeout: float, count: int = 1, proc: subprocess.Popen | None = None) -> bool:
        """True once `message` arrived `count` times; False on timeout or when `proc` exits first."""
        deadline = time.monotonic() + timeout
        while self.messages.count(message) < count:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                time.sleep(0.2)  # what was sent just before the exit
                return self.messages.count(message) >= count
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self._closed = True
        self._thread.join(1)
        self.sock.close()


class Output:
    """Collects a process's output lines in a thread, so the test can wait for one."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                m = re.search(pattern, line)
                if m:
                    return m
            time.sleep(0.05)
        return None

    @property
    def text(self) -> str:
        self._thread.join(0.5)
        return "\n".join(self.lines)


def start(argv: list[str], env: dict, cwd: Path = ROOT) -> tuple[subprocess.Popen, Output]:
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, Output(proc.stdout)


def daemon_env(notify: NotifyListener | None = None, watchdog_usec: int | None = None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURBONODE_", "NOTIFY_", "WATCHDOG_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    if notify:
        env["NOTIFY_SOCKET"] = notify.path
    if watchdog_usec:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    env.update(extra)
    return env


def turboctl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "turboctl", *args]


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, wait; SIGKILL only if it does not exit (a test failure either way)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"pid {proc.pid} ignored SIGTERM for {timeout}s") from None
    return proc.returncode


def scrape(url: str, timeout: float = 10) -> str:
    from urllib.request import urlopen

    with urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def promtool_check(text: str) -> subprocess.CompletedProcess:
    """`promtool check metrics` on an exposition; returncode 0 means no lint problem."""
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)


PROMTOOL_SKIP = None if shutil.which("promtool") else "promtool not installed (Debian package prometheus)"


def kill_9_once(script: str, ready: str = "engaged") -> None:
    """Run `script` (Python, from the repo root) until it prints `ready`, then kill -9 it: an agent
    that dies holding what it changed, with no shutdown path run."""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == ready
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
