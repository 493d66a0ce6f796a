"""What both daemons add to their exposition (turbonode/exposition.py): `node` on every series,
build info with the git revision, process metrics; served through prometheus_client's own
HTTP server, `?name[]=` filtering included, and checked with promtool."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import Counter, Histogram, generate_latest, start_http_server

from tests.helpers import PROMTOOL_SKIP, ROOT, promtool_check
from turbonode import __version__, exposition
from turbonode.metric_names import BUILD_INFO


def test_every_sample_gets_the_node_label_and_promtool_agrees():
    registry, served = exposition.daemon_registry("worker", "gpu-node-07", lambda: {"backend": "torch"})
    Counter("turbonode_x", "things", ["tier"], registry=registry).labels("turbo").inc(3)
    Histogram("turbonode_y_seconds", "waits", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    text = generate_latest(served).decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all('node="gpu-node-07"' in line for line in samples), text
    assert re.search(r'^turbonode_x_total\{node="gpu-node-07",tier="turbo"\} 3\.0$', text, re.M)
    assert re.search(r'^turbonode_y_seconds_bucket\{le="0\.1",node="gpu-node-07"\} 0\.0$', text, re.M)
    info = re.search(rf"^{BUILD_INFO}\{{(.*)\}} 1\.0$", text, re.M)
    assert info, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert labels["component"] == "worker" and labels["version"] == __version__ and labels["backend"] == "torch"
    assert labels["revision"] == exposition.revision() and labels["node"] == "gpu-node-07"
    assert re.search(r'^process_resident_memory_bytes\{node="gpu-node-07"\} [\d.e+]+$', text, re.M), text
    if not PROMTOOL_SKIP:
        res = promtool_check(text)
        assert res.returncode == 0, res.stdout + res.stderr


def test_build_info_reads_extra_labels_at_scrape_time():
    backend: dict[str, str] = {}
    registry, served = exposition.daemon_registry("worker", "n", lambda: backend)
    assert "backend=" not in generate_latest(served).decode()  # still loading its model
    backend.update(backend="tensorrt", device="cuda:0", model_family="sd")
    assert re.search(r'backend="tensorrt".*device="cuda:0"', generate_latest(served).decode())


def test_node_defaults_to_the_hostname():
    import socket

    assert exposition.node_name("") == socket.gethostname()
    assert exposition.node_name("gpu-node-01") == "gpu-node-01"


def test_served_by_prometheus_client_with_name_filter():
    """The agent serves through prometheus_client's start_http_server; ?name[]= keeps the label."""
    registry, served = exposition.daemon_registry("agent", "n1")
    Counter("turbonode_z", "z", registry=registry).inc()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=served)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?name[]=turbonode_z_total", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples == ['turbonode_z_total{node="n1"} 1.0'], text


def _git(root: Path, ref: str = "refs/heads/main") -> Path:
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text(f"ref: {ref}\n")
    return git


def test_git_revision_from_files(tmp_path, monkeypatch):
    sha = "0123456789abcdef0123456789abcdef01234567"
    plain = tmp_path / "plain"
    (_git(plain) / "refs/heads/main").write_text(sha + "\n")
    assert exposition.git_revision(plain) == sha[:12]

    packed = tmp_path / "packed"
    (_git(packed) / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert exposition.git_revision(packed) == sha[:12]

    detached = tmp_path / "detached"
    _git(detached)
    (detached / ".git/HEAD").write_text(sha + "\n")
    assert exposition.git_revision(detached) == sha[:12]

    # a worktree: .git is a file naming its gitdir; branches live in the common directory
    common = _git(tmp_path / "main")
    (common / "refs/heads/feature").write_text(sha + "\n")
    gitdir = common / "worktrees" / "wt"
    gitdir.mkdir(parents=True)
    (gitdir / "HEAD").write_text("ref: refs/heads/feature\n")
    (gitdir / "commondir").write_text("../..\n")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {gitdir}\n")
    assert exposition.git_revision(wt) == sha[:12]

    assert exposition.git_revision(tmp_path / "nothing") is None
    monkeypatch.setenv(exposition.REVISION_ENV, "img-abc123")
    assert exposition.revision() == "img-abc123"


def test_git_revision_of_this_checkout():
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        pytest.skip("git not installed")
    if head.returncode != 0:
        pytest.skip(f"not a git checkout: {head.stderr.strip()}")
    assert exposition.git_revision(ROOT) == head.stdout.strip()


def test_the_image_carries_its_revision():
    """The image has no .git: deploy/Dockerfile passes the revision in the variable revision() reads."""
    text = (ROOT / "deploy/Dockerfile").read_text()
    assert re.search(r"^ARG REVISION=", text, re.M) and f"{exposition.REVISION_ENV}=$REVISION" in text
