"""What tests in more than one folder share: the repository's root, marks for tests that need the
kernel (root, bpf, bcc), turboctl daemons started as real subprocesses the way systemd would
with a listener for their sd_notify, the agent's stand-ins for a worker (MiniWorker) and for
/proc (FakeProc), and small HTTP clients for a worker.

A NOTIFY_SOCKET datagram socket in a temp directory stands in for systemd's, and promtool checks
what the daemons serve on /metrics. Fixtures are in conftest.py files, requested by name.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from turbonode.jsonrpc import INVALID_PARAMS, ControlClient, RpcError
from turbonode.rpc_server import UnixRpcServer

ROOT = Path(__file__).resolve().parent.parent


# ---- what the machine can run ---------------------------------------------------------------


def _kernel_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, bpf)"
    if shutil.which("ip") is None:
        return "iproute2 'ip' not installed"
    if not os.path.isdir("/sys/fs/bpf"):
        return "no bpffs at /sys/fs/bpf (kernel without bpf syscall?)"
    return None


def _bcc_skip_reason() -> str | None:
    reason = _kernel_skip_reason()
    if reason:
        return reason
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc Python bindings (python3-bpfcc) not importable: run scripts/setup.sh"
    return None


KERNEL_SKIP = _kernel_skip_reason()
BCC_SKIP = _bcc_skip_reason()
needs_root = pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
needs_bcc = pytest.mark.skipif(BCC_SKIP is not None, reason=BCC_SKIP or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- daemons as systemd runs them -------------------------------------------------------------


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


# ---- the agent's stand-ins ---------------------------------------------------------------------


class MiniWorker:
    """Just enough of the worker's control contract: status with GC seq, events (long poll),
    throttle with TTL. `with_events=False` is a worker from before `events`."""

    def __init__(self, with_events: bool = True):
        self.pauses = []
        self.throttle_state = None
        self.calls = []
        self.throttled_at: list[float] = []  # wall clock of each throttle call, as it arrived
        self.turbo_wait = 0.0
        self.with_events = with_events
        self.changed = threading.Condition()

    def _last_seq(self) -> int:
        return self.pauses[-1]["seq"] if self.pauses else 0

    def _tiers(self) -> dict:
        return {"turbo": {"queued": 1, "in_flight": 0, "oldest_wait_s": self.turbo_wait, "queue_wait_p99_s": 0.0}}

    def status(self, since_gc_seq=None):
        t = self.throttle_state
        if t and time.monotonic() > t["expires"]:
            self.throttle_state = t = None
        pauses = [p for p in self.pauses if since_gc_seq is None or p["seq"] > since_gc_seq]
        return {
            "tiers": self._tiers(),
            "step_time_s": {"last": 0.04, "p50": 0.04, "p99": 0.05},
            "max_batch": 4,
            "gc": {"last_seq": self._last_seq(), "pauses": pauses},
            "throttle": t and {k: v for k, v in t.items() if k != "expires"},
            "backend": {"name": "mini", "device": "cpu"},
            "uptime_s": 1.0,
        }

    def events(self, since_gc_seq=None, gc_pause_s=None, turbo_wait_s=None, timeout_s=1.0):
        cursor = self._last_seq() if since_gc_seq is None else since_gc_seq
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                new = [p for p in self.pauses if p["seq"] > cursor]
                if gc_pause_s is not None and any(p["pause_s"] > gc_pause_s for p in new):
                    event = "gc_pause"
                elif turbo_wait_s is not None and self.turbo_wait > turbo_wait_s:
                    event = "turbo_wait"
                elif cursor <= self._last_seq() and self.changed.wait(max(0.0, deadline - time.monotonic())):
                    continue
                else:
                    event = None
                return {"event": event, "gc": {"last_seq": self._last_seq(), "pauses": new}, "tiers": self._tiers()}

    def throttle(
        self,
        reason,
        ttl_s,
        max_batch=None,
        paused_tiers=(),
        step_caps=None,
        shed_tiers=(),
        unready_tiers=(),
        intra_op_threads=None,
        lock_memory=False,
    ):
        if "turbo" in list(paused_tiers) + list(shed_tiers) + list(step_caps or {}):
            raise RpcError(INVALID_PARAMS, "turbo is never throttled")
        self.calls.append(("throttle", reason))
        self.throttled_at.append(time.time())
        self.throttle_state = {
            "max_batch": max_batch,
            "paused_tiers": list(paused_tiers),
            "intra_op_threads": intra_op_threads,
            "lock_memory": lock_memory,
            "reason": reason,
            "expires": time.monotonic() + ttl_s,
        }
        return {"ok": True}

    def ping(self):
        return {"pong": True, "pid": os.getpid()}  # this test process: what `levers.worker_cgroup = "auto"` finds

    def release(self, reason=""):
        self.calls.append(("release", reason))
        self.throttle_state = None
        return {"ok": True}

    def gc(self, pause_s):
        with self.changed:
            self.pauses.append({"seq": len(self.pauses) + 1, "generation": 2, "pause_s": pause_s, "at": time.time()})
            self.changed.notify_all()

    def set_turbo_wait(self, seconds):
        with self.changed:
            self.turbo_wait = seconds
            self.changed.notify_all()

    def serve(self, path: str) -> UnixRpcServer:
        self.client = ControlClient(path, timeout=1.0)
        methods = {"status": self.status, "throttle": self.throttle, "release": self.release, "ping": self.ping}
        if self.with_events:
            methods["events"] = self.events
        return UnixRpcServer(path, methods).start()


class FakeProc:
    """A procfs root whose /proc/stat the test drives, so CPU load is reproducible on a shared
    machine (the real CPU fault is bench/detection.py's; the real /proc/stat read is in
    tests/agent/test_watchers.py). The other files are copies of the real ones."""

    def __init__(self, root: Path):
        self.root, self.busy, self.jiffies = root, 0.0, [0, 0]
        for rel in ("softirqs", "net/softnet_stat", "self/mounts", "pressure/cpu", "pressure/memory", "pressure/io"):
            if os.path.exists(f"/proc/{rel}"):
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(Path(f"/proc/{rel}").read_text())
        self._stop = threading.Event()
        self._tick()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tick(self):
        busy = round(10 * self.busy)
        self.jiffies = [self.jiffies[0] + busy, self.jiffies[1] + 10 - busy]
        tmp = self.root / "stat.tmp"
        tmp.write_text(f"cpu  {self.jiffies[0]} 0 0 {self.jiffies[1]} 0 0 0 0 0 0\n")
        tmp.rename(self.root / "stat")  # atomic: the agent never reads half a file

    def _run(self):
        while not self._stop.wait(0.02):
            self._tick()

    def close(self):
        self._stop.set()
        self.thread.join()


# ---- a worker's HTTP API ------------------------------------------------------------------------


def readyz(url: str, tier: str | None = None) -> tuple[int, dict, dict]:
    path = "/readyz" + (f"?tier={tier}" if tier else "")
    try:
        with urllib.request.urlopen(url + path, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def call(url, method="POST", path="/v1/images/generations", body=None, key=None, headers=None, source=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0) if source else None)
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key:
        sent["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=sent)
    resp = conn.getresponse()
    out = resp.status, resp.headers, json.loads(resp.read() or b"null")  # headers: any case (HAProxy lowers)
    conn.close()
    return out
