"""The units under a real systemd: a container boots one (tests/deploy/helpers.py), the units,
sysusers and tmpfiles are installed as docs/service.md says, and a node of two workers
(`[workers.a]`, `[workers.b]`: turbonode-worker@a and @b beside one agent) is run as an operator
would: start, serve, lose a worker, hang, crash, stop, misconfigure.

One container serves the whole module and the tests run in file order, each leaving the node in
the state the next expects (the bad configuration comes last). The container runs in the node
namespace of a Sandbox; requests come from its client namespace over the veth pair.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest

from sandbox.netns import Sandbox
from tests.deploy.helpers import Container, skip_reason
from tests.helpers import ROOT

pytestmark = [pytest.mark.root, pytest.mark.slow]

AGENT, MOUNTS, TARGET = "turbonode-agent.service", "turbonode-mounts.service", "turbonode-workers.target"
NAMES = ("a", "b")
WORKERS = tuple(f"turbonode-worker@{n}.service" for n in NAMES)
WORKER = WORKERS[0]
PORTS = {n: 8460 + i for i, n in enumerate(NAMES)}  # worker.listen's port plus the worker's position
CONFIG = "/etc/turbonode/turbonode.toml"
TURBOCTL = "/opt/turbonode/.venv/bin/turboctl"
DOCS = ROOT / "docs/service.md"
# docs/service.md's install steps after the checkout and scripts/setup.sh (the container shares
# the host's packages and this checkout's .venv), run as written in /opt/turbonode.
INSTALL = (
    "install -m644 systemd/turbonode.sysusers.conf /usr/lib/sysusers.d/turbonode.conf",
    "install -m644 systemd/turbonode.tmpfiles.conf /usr/lib/tmpfiles.d/turbonode.conf",
    "systemd-sysusers && systemd-tmpfiles --create turbonode.conf",
    "install -m644 systemd/turbonode-mounts.service systemd/turbonode-agent.service systemd/turbonode-worker@.service"
    " systemd/turbonode-workers.target /etc/systemd/system/",
    ".venv/bin/turboctl config example > /etc/turbonode/turbonode.toml",
)
CONFIG_CHECK = ".venv/bin/turboctl config check /etc/turbonode/turbonode.toml"
ENABLE = (
    "systemctl daemon-reload && systemctl enable --now turbonode-agent turbonode-workers.target"
    " $(.venv/bin/turboctl config workers --units /etc/turbonode/turbonode.toml)"
)
DRAIN_JOB_S = 2.0

T = TypeVar("T")


@dataclass
class Node:
    box: Container
    sandbox: Sandbox
    timings: dict[str, float]

    def url(self, name: str = NAMES[0]) -> str:
        return f"http://{self.sandbox.server_ip}:{PORTS[name]}"

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.box.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def kill_main(self, unit: str, signal: str) -> None:
        """`signal` to the unit's main process (systemd picks it: never a stale or zero pid)."""
        assert self.show(unit, "ActiveState")["ActiveState"] == "active", f"{unit} is not running"
        self.box.run("systemctl", "kill", "--kill-whom=main", f"--signal={signal}", unit)

    def journal(self, unit: str, *args: str, current: bool = False) -> str:
        """The daemon's own lines (not systemd's about it), as text; `current`: this run's only."""
        if current:
            args = (f"_SYSTEMD_INVOCATION_ID={self.show(unit, 'InvocationID')['InvocationID']}", *args)
        return self.box.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, "-t", "turboctl", *args).stdout

    def agent_status(self) -> dict:
        """The agent's status (`turboctl status` exits 1 while a worker does not answer: still printed)."""
        return json.loads(self.box.run(TURBOCTL, "status", "--json", check=False).stdout)["agent"]

    def _render_argv(self, name: str, *args: str) -> list[str]:
        """`turboctl render` as a client of the node, to worker `name`'s URL."""
        return [str(ROOT / ".venv/bin/turboctl"), "render", "a lighthouse", "--url", self.url(name), "--json", *args]

    def render(self, *args: str, worker: str = NAMES[0], timeout: float = 120) -> subprocess.CompletedProcess:
        """An image from the client namespace, through the veth and the shaped device."""
        return self.sandbox.run(self.sandbox.client, *self._render_argv(worker, *args), timeout=timeout, check=False)

    def render_popen(self, *args: str) -> subprocess.Popen:
        return self.sandbox.popen(
            self.sandbox.client,
            *self._render_argv(NAMES[0], *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def datapath(self) -> dict:
        """What is on the node's device and in bpffs, as sorted lists (duplicates would show)."""
        dev = self.sandbox.dev

        def tc(kind: str) -> list[dict]:
            return json.loads(self.box.run("tc", "-j", kind, "show", "dev", dev).stdout or "[]")

        pins = self.box.run("find", "/sys/fs/bpf/turbonode", "-mindepth", "1").stdout.split()
        # rates left out: the agent moves the relax ceiling; iproute2 6.1 has no JSON for htb classes
        classes = self.box.run("tc", "class", "show", "dev", dev).stdout
        return {
            "qdiscs": sorted(f"{q['kind']} {q['handle']} {q.get('parent', 'root')}" for q in tc("qdisc")),
            "classes": sorted(re.findall(r"^class (\S+ \S+ (?:root|parent \S+))", classes, re.M)),
            "filters": sorted(
                f"{f.get('options', {}).get('bpf_name')} prio {f.get('pref')}"
                for f in tc("filter")
                if f.get("kind") == "bpf" and "options" in f
            ),
            "pins": sorted(pins),
        }


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_restarted(node: Node, unit: str, old_pid: str, old_restarts: int, timeout: float) -> dict[str, str]:
    """systemd brought `unit` back: a new main pid, one more restart, active again."""

    def back() -> dict[str, str] | None:
        s = node.show(unit, "ActiveState", "MainPID", "NRestarts", "Result")
        ok = s["ActiveState"] == "active" and s["MainPID"] not in ("0", old_pid) and int(s["NRestarts"]) > old_restarts
        return s if ok else None

    return wait_for(f"{unit} to be restarted", back, timeout)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(f"cannot boot a systemd container here: {reason}")
    docs = DOCS.read_text()
    for line in (*INSTALL, CONFIG_CHECK, ENABLE):
        assert line in docs, f"docs/service.md no longer says `{line}`: the test installs as the docs say"
    console = tmp_path_factory.mktemp("systemd") / "console.log"
    with Sandbox() as sb:
        box = Container(sb.server, console)
        timings = {"boot": box.boot()}
        try:
            yield Node(box, sb, timings)
        finally:
            journal = console.with_name("journal.txt")
            journal.write_text(box.run("journalctl", "--no-pager", "-o", "short-precise", check=False).stdout)
            print(f"\nsystemd container timings (s): {timings}; its journal: {journal}")
            box.close()


def test_units_reach_active_and_say_what_they_do(node):
    box = node.box
    # systemd mounts neither in a container: what the agent gets comes from turbonode-mounts.service
    assert box.run("findmnt", "/sys/fs/bpf", check=False).returncode != 0
    assert box.run("findmnt", "/sys/kernel/tracing", check=False).returncode != 0
    start = time.monotonic()
    box.sh("cd /opt/turbonode && " + " && ".join(INSTALL))
    # docs: "then set qos.dev, qos.rate, and one [workers.<name>] table per GPU"; the device is the
    # container's end of the veth pair, the workers two CPU ones
    box.sh(f'sed -i \'s/^dev = ""/dev = "{node.sandbox.dev}"/; s/^rate = "1gbit"/rate = "100mbit"/\' {CONFIG}')
    box.sh(f"printf '[workers.a]\\n[workers.b]\\n' >> {CONFIG}")
    assert "OK" in box.sh(f"cd /opt/turbonode && {CONFIG_CHECK}").stdout
    enable = box.popen(
        "sh", "-c", f"cd /opt/turbonode && {ENABLE}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # while the model loads, `systemctl status` says so (STATUS= from the worker)
        loading = wait_for(
            "the worker's loading status", lambda: node.show(WORKER, "StatusText")["StatusText"] or None, 120, 0.1
        )
        assert "loading" in loading, loading
        out, _ = enable.communicate(timeout=300)
    finally:
        if enable.poll() is None:
            enable.kill()
    assert enable.returncode == 0, out
    node.timings["install+start"] = time.monotonic() - start
    units = (MOUNTS, AGENT, TARGET, *WORKERS)
    assert box.run("systemctl", "is-active", *units).stdout.split() == ["active"] * len(units)
    for where, fstype in (("/sys/fs/bpf", "bpf"), ("/sys/kernel/tracing", "tracefs")):
        assert box.run("findmnt", "-n", "-o", "FSTYPE", where).stdout.strip() == fstype
    for unit, says in (
        (AGENT, rf"shaping {node.sandbox.dev}"),
        *((w, rf"serving http://\S+:{PORTS[n]}") for n, w in zip(NAMES, WORKERS)),
    ):
        status = box.run("systemctl", "status", "--no-pager", unit).stdout
        assert re.search(rf'Status: ".*{says}', status), status
    # the agent started once both workers were up (READY=1: the model loaded), as its After= says
    agent_start = int(node.show(AGENT, "ExecMainStartTimestampMonotonic")["ExecMainStartTimestampMonotonic"])
    for unit in WORKERS:
        ready = int(node.show(unit, "ActiveEnterTimestampMonotonic")["ActiveEnterTimestampMonotonic"])
        assert 0 < ready <= agent_start, (unit, ready, agent_start)
    st = wait_for(
        "both workers in the agent's status",
        lambda: (
            (s := node.agent_status())["workers"].keys() == set(NAMES)
            and all(w["state"] == "ok" for w in s["workers"].values())
            and s
        ),
        30,
    )
    softirq = st["watchers"]["softirq"]
    # tracefs from turbonode-mounts.service is visible in the agent's namespace: BPF, no fallback
    assert softirq["ok"] and softirq.get("mode") != "procfs", softirq
    sockets = {n: w["socket"] for n, w in st["workers"].items()}
    assert sockets == {n: f"/run/turbonode/worker-{n}.sock" for n in NAMES}, sockets


def test_each_worker_answers_and_agent_status_shows_the_datapath(node):
    for name in NAMES:
        res = node.render("--tier", "turbo", "--size", "64x64", "--steps", "2", "--out", "/dev/null", worker=name)
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads(res.stdout)["tier"] == "turbo"
    dp = node.agent_status()["datapath"]
    assert dp["dev"] == node.sandbox.dev and dp["rate_bps"] == 100_000_000, dp
    # the image went back through the classifier as turbo (the worker marks its socket EF)
    wait_for("turbo bytes in the agent's status", lambda: node.agent_status()["qos"]["turbo"]["bytes"] > 0, 10)
    text = node.box.run(TURBOCTL, "status").stdout
    assert node.sandbox.dev in text, text
    for name in NAMES:  # every worker of the node, each at its own socket
        assert re.search(rf"^worker {name}: ok \(/run/turbonode/worker-{name}\.sock\)", text, re.M), text


def test_journal_priorities(node):
    """Lifecycle events at info, warnings at warning: `journalctl -p` filters by what happened."""
    for unit in WORKERS:
        info = node.journal(unit, "-p", "info")
        warning = node.journal(unit, "-p", "warning")
        loaded = re.search(r"model \S+ loaded in [\d.]+ s", info)
        assert loaded, info
        assert loaded.group(0) not in warning and "serving" not in warning
    st = node.agent_status()
    failed = [f"{name} watcher failed" for name, w in st["watchers"].items() if not w["ok"]]
    failed += [
        f"worker {n}: {k} watcher failed"
        for n, w in st["workers"].items()
        for k, v in w["watchers"].items()
        if not v["ok"]
    ]
    agent_warnings = node.journal(AGENT, "-p", "warning")
    for line in failed:  # e.g. gpu without NVML: reported as a warning, not as info
        assert line in agent_warnings, (line, agent_warnings)
    assert f"datapath: shaping {node.sandbox.dev} at 100mbit" in node.journal(AGENT, "-p", "info")
    assert "datapath:" not in agent_warnings


def test_the_agent_drives_one_worker_while_another_is_down(node):
    """A worker that stops (or never comes) is that worker's failed state: the agent, started
    without it, drives the other, and takes it on again when it is back."""
    box, (a, b) = node.box, NAMES
    box.run("systemctl", "stop", WORKERS[1], timeout=120)
    box.run("systemctl", "restart", AGENT, timeout=120)  # it starts although b is down
    seen = lambda: node.agent_status()["workers"]
    st = wait_for(
        "the agent to see b absent and a ok",
        lambda: (w := seen())[b]["state"] == "absent" and w[a]["state"] == "ok" and w,
        30,
    )
    assert "does not exist" in st[b]["error"] or "refused" in st[b]["error"], st[b]
    res = box.run(TURBOCTL, "throttle", "--worker", a, "--max-batch", "1", "--reason", "check", "--ttl", "5")
    assert "throttled (check)" in res.stdout, res.stdout + res.stderr
    status = box.run(TURBOCTL, "status", check=False)
    assert status.returncode == 1 and re.search(rf"^worker {b}: unreachable", status.stdout, re.M), status.stdout
    box.run(TURBOCTL, "release", "--worker", a)
    box.run("systemctl", "start", WORKERS[1], timeout=300)
    wait_for("the agent to see b again", lambda: seen()[b]["state"] == "ok", 30)


def test_watchdog_restarts_a_stopped_daemon(node):
    before = {u: node.show(u, "MainPID", "NRestarts") for u in (AGENT, *WORKERS)}
    for unit in before:
        node.kill_main(unit, "SIGSTOP")
    start = time.monotonic()
    for unit, s in before.items():
        after = wait_restarted(node, unit, s["MainPID"], int(s["NRestarts"]), 150)
        assert after["Result"] == "success"  # the new instance; the old one's result is in the journal
    node.timings["watchdog restarts"] = time.monotonic() - start
    for unit in (AGENT, *WORKERS):
        log = node.box.run("journalctl", "--no-pager", "-o", "cat", "-u", unit).stdout
        assert "Watchdog timeout" in log and "Failed with result 'watchdog'" in log, log[-2000:]


def test_kill_9_restarts_and_reconciles_without_duplicates(node):
    before = node.datapath()
    assert len(before["filters"]) == 1 and before["pins"], before
    state = {u: node.show(u, "MainPID", "NRestarts") for u in (AGENT, *WORKERS)}
    for unit in state:
        node.kill_main(unit, "SIGKILL")
    start = time.monotonic()
    for unit, s in state.items():
        wait_restarted(node, unit, s["MainPID"], int(s["NRestarts"]), 120)
    node.timings["kill -9 restarts"] = time.monotonic() - start
    assert node.datapath() == before  # same qdiscs, classes, one filter, same pins
    applied = node.journal(AGENT, current=True)
    assert "classifier prog" in applied and "kept (already attached)" in applied, applied
    for name in NAMES:
        res = node.render("--tier", "turbo", "--size", "64x64", "--steps", "2", "--out", "/dev/null", worker=name)
        assert res.returncode == 0, res.stdout + res.stderr


def test_engine_process_killed_restarts_the_worker(node):
    """kill -9 of the worker's engine process (not its main PID): the front fails what waited,
    exits 1, and systemd restarts the whole worker."""
    s = node.show(WORKER, "MainPID", "NRestarts")
    engines = node.box.run("pgrep", "-P", s["MainPID"]).stdout.split()
    assert len(engines) == 1, engines
    node.box.run("kill", "-9", engines[0])
    wait_restarted(node, WORKER, s["MainPID"], int(s["NRestarts"]), 120)
    log = node.box.run("journalctl", "--no-pager", "-o", "cat", "-u", WORKER).stdout
    assert "the engine process exited (status -9); stopping" in log, log[-2000:]
    res = node.render("--tier", "turbo", "--size", "64x64", "--steps", "2", "--out", "/dev/null")
    assert res.returncode == 0, res.stdout + res.stderr


def test_stop_drains_the_worker_and_leaves_the_datapath(node):
    before = node.datapath()

    def worker_status() -> dict:
        return json.loads(node.box.run(TURBOCTL, "worker", "status", "--worker", NAMES[0], "--json").stdout)

    # A job that runs about DRAIN_JOB_S on this machine as loaded as it is now: still running when
    # SIGTERM comes, well inside worker.drain_timeout (30 s) even if the machine gets busier.
    res = node.render("--tier", "turbo", "--size", "64x64", "--steps", "10", "--out", "/dev/null")
    assert res.returncode == 0, res.stdout + res.stderr
    step = worker_status()["step_time_s"]["p50"]
    steps = max(10, min(100, round(DRAIN_JOB_S / step)))
    job = node.render_popen("--tier", "turbo", "--size", "64x64", "--steps", str(steps), "--out", "/dev/null")
    try:
        wait_for("the job to run", lambda: worker_status()["tiers"]["turbo"]["in_flight"] > 0, 60, 0.1)
        node.box.run("systemctl", "stop", WORKER, timeout=120)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out  # the running job finished during the drain
    s = node.show(WORKER, "ActiveState", "Result")
    assert s == {"ActiveState": "inactive", "Result": "success"}, s
    info = node.journal(WORKER, "-p", "info")
    assert "draining: 1 running jobs" in info and "drained in" in info, info[-2000:]
    node.box.run("systemctl", "stop", AGENT, timeout=60)
    assert node.show(AGENT, "ActiveState")["ActiveState"] == "inactive"
    assert node.datapath() == before  # fail-static: qos.keep_on_stop = true (docs/service.md)


def test_security_exposure_is_recorded(node, capsys):
    docs = DOCS.read_text()
    for unit in (AGENT, WORKER, MOUNTS):
        out = node.box.run("systemd-analyze", "security", "--no-pager", unit).stdout
        m = re.search(rf"Overall exposure level for {re.escape(unit)}: ([\d.]+) (\w+)", out)
        assert m, out
        with capsys.disabled():
            print(f"\nsystemd-analyze security {unit}: {m.group(1)} {m.group(2)}")
        recorded = re.sub(r"@\w+\.", "@.", unit)  # an instance: its template's row
        assert f"`{recorded}` | {m.group(1)} | {m.group(2)}" in docs, "docs/service.md records another exposure"


def test_bad_config_fails_the_units_stops_them_and_names_the_key_at_err(node):
    box = node.box
    # Both daemons validate the whole file (it is shared): both refuse it, naming the key.
    box.sh(f"sed -i 's/^sample_period = .*/sample_period = -1/' {CONFIG}")
    check = box.run(TURBOCTL, "config", "check", CONFIG, check=False)
    assert check.returncode != 0 and "agent.sample_period" in check.stderr, check
    box.run("systemctl", "reset-failed", AGENT, *WORKERS)
    start = time.monotonic()
    box.run("systemctl", "restart", "--no-block", AGENT, *WORKERS)

    def gave_up(unit: str) -> bool:
        log = box.run("journalctl", "--no-pager", "-o", "cat", "-u", unit).stdout
        return node.show(unit, "ActiveState")["ActiveState"] == "failed" and "Start request repeated too quickly" in log

    for unit in (AGENT, *WORKERS):
        wait_for(f"{unit} to hit its start limit", lambda unit=unit: gave_up(unit), 120)
    node.timings["start limit"] = time.monotonic() - start
    restarts = {u: node.show(u, "NRestarts")["NRestarts"] for u in (AGENT, *WORKERS)}
    time.sleep(5)  # stopped for good: no further restart
    assert {u: node.show(u, "NRestarts", "ActiveState") for u in (AGENT, *WORKERS)} == {
        u: {"NRestarts": n, "ActiveState": "failed"} for u, n in restarts.items()
    }
    for unit in (AGENT, *WORKERS):
        errors = node.journal(unit, "-p", "err")
        assert "agent.sample_period: must be" in errors, node.journal(unit)[-2000:]
