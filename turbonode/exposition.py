"""What both daemons add to their Prometheus exposition: the `node` label on every series,
`turbonode_build_info`, and prometheus_client's standard `process_*` metrics.

The node label is the reason the dashboard can show one node: Prometheus scrapes the agent
(:9465) and the worker (:8460) as two instances, and a target label set by relabeling is
only as good as each operator's scrape configuration; NVIDIA's dcgm-exporter labels its
series with the host for the same reason. `node` defaults to the hostname; `node.name` in
the configuration (TURBONODE_NODE_NAME, e.g. from Kubernetes' spec.nodeName) overrides it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric

from . import __version__
from .metric_names import BUILD_INFO, NODE_LABEL, WORKER_LABEL

REVISION_ENV = "TURBONODE_REVISION"  # set by deploy/Dockerfile, where the image has no .git
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def node_name(configured: str = "") -> str:
    return configured or socket.gethostname()


def git_revision(root: Path = SOURCE_ROOT) -> str | None:
    """The checkout's commit, read from .git without running git: the daemons run as users
    git would refuse ("dubious ownership") in a checkout root owns, and hosts may lack git."""
    dot_git = root / ".git"
    try:
        if dot_git.is_file():  # a worktree or submodule: "gitdir: <path>"
            gitdir = Path(dot_git.read_text().partition("gitdir:")[2].strip())
            gitdir = gitdir if gitdir.is_absolute() else root / gitdir
        elif dot_git.is_dir():
            gitdir = dot_git
        else:
            return None
        head = (gitdir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:12] or None  # detached
        ref = head[4:].strip()
        common = gitdir / (gitdir / "commondir").read_text().strip() if (gitdir / "commondir").exists() else gitdir
        for base in (gitdir, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()[:12]
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name == ref:
                    return sha[:12]
    except OSError:
        return None
    return None


def revision() -> str:
    return os.environ.get(REVISION_ENV) or git_revision() or "unknown"


class BuildInfo:
    """turbonode_build_info{component, version, revision, ...} 1; `extra` is read at every
    scrape, so the worker's backend and model appear once its model has loaded."""

    def __init__(self, component: str, extra: Callable[[], dict[str, str]] | None = None):
        self.labels = {"component": component, "version": __version__, "revision": revision()}
        self.extra = extra

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = {**self.labels, **(self.extra() if self.extra else {})}
        family = GaugeMetricFamily(
            BUILD_INFO,
            "turbonode's version, git revision and, on the worker, backend, device and model family; always 1",
            labels=list(labels),
        )
        family.add_metric(list(labels.values()), 1)
        yield family


def labelled(metrics: Iterable[Metric], labels: dict[str, str]) -> Iterator[Metric]:
    """The metrics with `labels` added to every sample (a sample's own labels win)."""
    for metric in metrics:
        out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
        out.samples = [s._replace(labels={**labels, **s.labels}) for s in metric.samples]
        yield out


class NodeLabelled:
    """A registry's exposition with NODE_LABEL (and a worker's WORKER_LABEL) added to every
    sample; what the /metrics handlers serve (prometheus_client's exposition takes any object
    with these two methods)."""

    def __init__(self, registry: Any, node: str, worker: str | None = None):
        self.registry, self.node, self.worker = registry, node, worker
        self.labels = {NODE_LABEL: node, **({WORKER_LABEL: worker} if worker is not None else {})}

    def collect(self) -> Iterator[Metric]:
        return labelled(self.registry.collect(), self.labels)

    def restricted_registry(self, names: Iterable[str]) -> NodeLabelled:
        """`/metrics?name[]=...`: the same filter prometheus_client applies, still labelled."""
        return NodeLabelled(self.registry.restricted_registry(names), self.node, self.worker)


def daemon_registry(
    component: str, node: str, build_extra: Callable[[], dict[str, str]] | None = None, worker: str | None = None
) -> tuple[CollectorRegistry, NodeLabelled]:
    """A fresh registry with build info and process metrics, and its labelled view to serve
    (`worker`: the worker's name, on a worker)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BuildInfo(component, build_extra))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, _resident_memory_bytes, _open_fds ...
    return registry, NodeLabelled(registry, node_name(node), worker)
