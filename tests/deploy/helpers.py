"""What the tests of the deployment artefacts share: a real systemd booted in a container, a real
Prometheus on loopback, and the shipped HAProxy configuration pointed at a test's servers.

The container (systemd-nspawn, see tests/deploy/systemd_container.sh) has a throwaway overlay of
this machine's root as its root, this checkout at /opt/turbonode, no bpffs and no tracefs (what
it mounts is its own), and runs in a network namespace the test created (never the host's), in
a cgroup of its own. Commands run inside it through nsenter. close() powers it off and removes
what boot() made, also after a failed boot; the private mount namespace takes every mount with
it.

Prometheus is Debian's `prometheus` binary, with a temporary configuration and storage, started,
queried over its HTTP API, stopped and removed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import ROOT, free_port

HAPROXY_CONFIG = ROOT / "deploy/haproxy/turbonode.cfg"
# where the metrics the dashboard and the rules query are defined, and the suffixes their series add
SOURCES = ("agent", "render", "tc", "turbonode")
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
SCRIPT = Path(__file__).with_name("systemd_container.sh")
NAMESPACES = ("--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup")
# What a command run inside sees: nothing of the test's own environment.
CONTAINER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
    "SYSTEMD_LESS": "",
}


class BootError(Exception):
    """The container did not come up; the message carries the end of its console."""


def cgroup_parents() -> list[Path]:
    """This process's cgroup in each hierarchy nspawn uses: cgroup2 and the name=systemd one."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2":
                mounts.setdefault("", fields[4])
            elif fstype == "cgroup" and "name=systemd" in options:
                mounts.setdefault("name=systemd", fields[4])
    out = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers in mounts:
                out.append(Path(mounts[controllers] + path))
    return out


def skip_reason() -> str | None:
    """Why this machine cannot boot the container, or None."""
    if os.geteuid() != 0:
        return "needs root (mount namespaces, cgroups, systemd-nspawn)"
    for tool, package in (
        ("systemd-nspawn", "systemd-container"),
        ("unshare", "util-linux"),
        ("nsenter", "util-linux"),
        ("setpriv", "util-linux"),
        ("ip", "iproute2"),
    ):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian package {package}; scripts/setup.sh installs it)"
    filesystems = Path("/proc/filesystems").read_text().split()
    for fs in ("overlay", "bpf", "tmpfs"):
        if fs not in filesystems:
            return f"the kernel has no {fs} filesystem (needed for the container's root and the agent's pins)"
    if not cgroup_parents():
        return "neither a cgroup2 nor a name=systemd cgroup hierarchy is mounted: systemd cannot run"
    if not (ROOT / ".venv/bin/turboctl").exists():
        return "no .venv with turboctl in the checkout (run scripts/setup.sh): the units run it"
    return None


class Container:
    """`boot()`, then `run(argv)` / `sh(script)` inside; `close()` always."""

    def __init__(self, netns: str, console: Path, checkout: Path = ROOT):
        self.tag = uuid.uuid4().hex[:8]
        self.machine = f"turbonode-test-{self.tag}"
        self.netns_path = f"/run/netns/{netns}"
        self.console_path = console
        self.checkout = checkout
        self.cgroups: list[Path] = []
        self.scratch: str | None = None
        self.proc: subprocess.Popen | None = None
        self.leader: int | None = None

    def boot(self, timeout: float = 120) -> float:
        """Start the container and wait until its systemd has booted; seconds it took."""
        start = time.monotonic()
        try:
            for parent in cgroup_parents():
                cg = parent / self.machine
                cg.mkdir()
                self.cgroups.append(cg)
            self.scratch = tempfile.mkdtemp(prefix="turbonode-nspawn-")
            with open(self.console_path, "wb") as console:
                # setpriv: nspawn powers the container off (SIGTERM) if the test process dies.
                self.proc = subprocess.Popen(
                    [
                        "unshare",
                        "--mount",
                        "--propagation",
                        "private",
                        "--",
                        "setpriv",
                        "--pdeathsig",
                        "TERM",
                        "--",
                        "bash",
                        str(SCRIPT),
                        str(self.checkout),
                        self.netns_path,
                        self.machine,
                        self.scratch,
                        *map(str, self.cgroups),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=console,
                    stderr=subprocess.STDOUT,
                )
            deadline = start + timeout
            self.leader = self._find_leader(deadline)
            self._wait_booted(deadline)
        except BaseException:
            self.close()
            raise
        return time.monotonic() - start

    def _find_leader(self, deadline: float) -> int:
        """The container's PID 1: the child of nspawn that is pid 1 of its own pid namespace."""
        assert self.proc is not None
        pid = self.proc.pid
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BootError(f"systemd-nspawn exited with status {self.proc.returncode}:\n{self.console()}")
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                children = []
            for child in children:
                try:
                    status = Path(f"/proc/{child}/status").read_text()
                except OSError:
                    continue
                nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
                if len(nspid) > 1 and nspid[-1] == "1":
                    return int(child)
            time.sleep(0.1)
        raise BootError(f"no container init after the boot timeout:\n{self.console()}")

    def _wait_booted(self, deadline: float) -> None:
        state = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise BootError(f"systemd-nspawn exited with status {self.proc.returncode}:\n{self.console()}")
            # fails until the container's systemd listens on its private socket
            res = self.run(
                "systemctl", "is-system-running", "--wait", check=False, timeout=max(1.0, deadline - time.monotonic())
            )
            state = res.stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.2)
        raise BootError(f"the container's systemd is {state or 'unreachable'} at the boot timeout:\n{self.console()}")

    def _argv(self, *argv: str) -> list[str]:
        """argv inside the container: its namespaces, a clean environment, root."""
        assert self.leader is not None, "boot() first"
        env = (f"{k}={v}" for k, v in CONTAINER_ENV.items())
        return ["nsenter", f"--target={self.leader}", *NAMESPACES, "--", "env", "-i", *env, *argv]

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(self._argv(*argv), capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(
                f"in the container, `{' '.join(argv)}` exited {res.returncode}:\n{res.stdout}{res.stderr}"
            )
        return res

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run("sh", "-c", script, **kw)

    def popen(self, *argv: str, **kw) -> subprocess.Popen:
        """argv inside the container, not waited for."""
        return subprocess.Popen(self._argv(*argv), **kw)

    def console(self, lines: int = 40) -> str:
        try:
            text = self.console_path.read_text(errors="replace")
        except OSError:
            return "(no console output)"
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Power off (nspawn turns SIGTERM into a clean shutdown), then remove what boot() made."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                if self.leader is not None:
                    _kill(self.leader)  # its pid namespace, and every process in it, dies with it
                self.proc.kill()
                self.proc.wait(10)
        for cg in self.cgroups:
            _remove_cgroup(cg)
        self.cgroups = []
        if self.scratch is not None:
            os.rmdir(self.scratch)  # empty: the tmpfs on it was in the private mount namespace
            self.scratch = None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_cgroup(top: Path, timeout: float = 10) -> None:
    """Remove the cgroup tree the container's systemd built under `top`, children first. Anything
    still in it is the container's, started by this test: killed by pid."""
    deadline = time.monotonic() + timeout
    while top.exists():
        for dirpath, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(dirpath)
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: processes left in it
                try:
                    pids = Path(dirpath, "cgroup.procs").read_text().split()
                except OSError:
                    pids = []
                for pid in pids:
                    _kill(int(pid))
        if time.monotonic() > deadline:
            raise RuntimeError(f"cgroup {top} could not be removed")
        time.sleep(0.1)


# ---- Prometheus -----------------------------------------------------------------------------------


PROMETHEUS_SKIP = None if shutil.which("prometheus") else "prometheus not installed (Debian package prometheus)"


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


# ---- HAProxy ----------------------------------------------------------------------------------------


def haproxy_config(workers: list[tuple[str, str, int]], stats: Path) -> str:
    """The shipped file with this fleet's servers (name, address, port: one per server line, by its
    id) and a stats socket in the test's directory."""
    text = HAPROXY_CONFIG.read_text().replace("/run/haproxy/turbonode.sock", str(stats))
    lines, seen = [], {}
    for line in text.splitlines():
        m = re.match(r"(\s+)server \S+ \S+:(\d+) id (\d) (.*)$", line)
        if m:
            name, addr, port = workers[int(m.group(3)) - 1]
            line = f"{m.group(1)}server {name} {addr}:{port} id {m.group(3)} {m.group(4)}"
            seen[m.group(3)] = True
        lines.append(line)
    assert len(seen) == len(workers)
    return "\n".join(lines) + "\n"


# ---- metric names the dashboard and the rules query ------------------------------------------------


def defined_metric_patterns(roots=SOURCES) -> set[str]:
    """Regexes of every `turbonode_*` metric name the source can build: string literals,
    PREFIX + "literal" with a module constant PREFIX, and f-strings (a {field} is any word).
    An f-string ending in a field (f"turbonode_{digest}", a program name) would match
    anything, so it does not count."""
    patterns = set()
    for root in roots:
        for path in (ROOT / root).rglob("*.py"):
            tree = ast.parse(path.read_text())
            consts = {
                t.id: n.value.value
                for n in tree.body
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            for node in ast.walk(tree):
                text = None
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = re.escape(node.value)
                elif (
                    isinstance(node, ast.BinOp)
                    and isinstance(node.op, ast.Add)
                    and isinstance(node.left, ast.Name)
                    and node.left.id in consts
                    and isinstance(node.right, ast.Constant)
                ):
                    text = re.escape(consts[node.left.id] + str(node.right.value))
                elif isinstance(node, ast.JoinedStr):
                    text = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in node.values)
                if text and re.fullmatch(r"turbonode_[\w\\+]+", text) and not text.endswith(r"\w+"):
                    patterns.add(text)
    return patterns


def undefined(names: set[str], patterns: set[str]) -> list[str]:
    def known(name: str) -> bool:
        candidates = [name] + [name[: -len(s)] for s in SUFFIXES if name.endswith(s)]
        return any(re.fullmatch(p, c) for p in patterns for c in candidates)

    missing = []
    for name in sorted(names):
        if name.startswith("re:"):  # a regex over names: some defined name must match it
            examples = [p.replace(r"\w+", "x").replace("\\", "") for p in patterns]
            if not any(re.fullmatch(name[3:], e) for e in examples):
                missing.append(name)
        elif not known(name):
            missing.append(name)
    return missing
