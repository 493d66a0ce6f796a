"""A real Prometheus (Debian's `prometheus` binary) on loopback for tests: a temporary
configuration and storage, started, queried over its HTTP API, stopped and removed."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS_SKIP = None if shutil.which("prometheus") else "prometheus not installed (Debian package prometheus)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """`with Prometheus(config) as prom: prom.query(...)`; config is the prometheus.yml dict."""

    def __init__(self, config: dict[str, Any], files: dict[str, str] | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="tn-prom-"))
        for name, text in (files or {}).items():
            (self.dir / name).write_text(text)
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / "prometheus.log"

    def __enter__(self) -> Prometheus:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            self._wait_ready(60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=20) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # a bad query: Prometheus says why in the body
            raise RuntimeError(f"{path} {params}: {exc.code} {exc.read().decode(errors='replace')}") from None
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query now: the result vector (or scalar/matrix as Prometheus gives it)."""
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, timeout: float) -> list[dict]:
        """Poll an instant query until it returns something."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]
