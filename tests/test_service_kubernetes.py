"""deploy/kubernetes/: every manifest parses, and the essentials agree with the contracts.

The checks are functions that return a list of problems, so the tests can show each one
finds what it is meant to find on a broken copy.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from turbonode.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy/kubernetes"
AGENT_CAPS = {"BPF", "PERFMON", "NET_ADMIN", "SYS_RESOURCE"}


def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _port(addr: str) -> int:
    return int(addr.rpartition(":")[2])


def _mounts(container: dict, pod: dict) -> dict[str, dict]:
    """mountPath -> the volume behind it."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def _host_path(volume: dict) -> str | None:
    return volume.get("hostPath", {}).get("path")


def config_problems(docs) -> list[str]:
    cm = docs[("ConfigMap", "turbonode-config")]
    problems = []
    for (kind, name), ds in docs.items():
        if kind != "DaemonSet":
            continue
        pod = ds["spec"]["template"]["spec"]
        c = pod["containers"][0]
        mounts = _mounts(c, pod)
        cfg_path = c["command"][c["command"].index("--config") + 1]
        vol = mounts.get(os.path.dirname(cfg_path), {})
        if (
            vol.get("configMap", {}).get("name") != cm["metadata"]["name"]
            or os.path.basename(cfg_path) not in cm["data"]
        ):
            problems.append(f"{name}: --config {cfg_path} is not the ConfigMap's file")
    return problems


def _common_problems(docs, role: str, port: int) -> tuple[dict, dict, list[str]]:
    """The pod spec and container of turbonode-<role>, and what is wrong with its command and port."""
    template = docs[("DaemonSet", f"turbonode-{role}")]["spec"]["template"]
    pod = template["spec"]
    c = pod["containers"][0]
    problems = []
    if c["command"][:3] != ["turboctl", role, "run"]:
        problems.append(f"{role}: command {c['command']}")
    if [p["containerPort"] for p in c["ports"]] != [port] or template["metadata"]["annotations"].get(
        "prometheus.io/port"
    ) != str(port):
        problems.append(f"{role}: port is not {port}")
    return pod, c, problems


def agent_problems(docs, cfg: Config) -> list[str]:
    pod, c, problems = _common_problems(docs, "agent", _port(cfg.agent.metrics))
    if not pod.get("hostNetwork"):
        problems.append("agent: hostNetwork must be true (it shapes the host's interface)")
    sc = c["securityContext"]
    caps = sc.get("capabilities", {})
    if set(caps.get("add", [])) != AGENT_CAPS or caps.get("drop") != ["ALL"] or sc.get("privileged"):
        problems.append(f"agent: capabilities {caps} (want drop ALL, add {sorted(AGENT_CAPS)}, not privileged)")
    mounts = _mounts(c, pod)
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}  # valueFrom: set by the kubelet
    procfs = load_config(os.devnull, env=env).agent.procfs  # what the daemon makes of its environment
    if procfs not in mounts or _host_path(mounts[procfs]) != "/proc":
        problems.append(f"agent: procfs root {procfs!r} is not the host's /proc")
    for path in ("/sys/fs/bpf", "/lib/modules", "/usr/src", "/sys/kernel/tracing"):
        if _host_path(mounts.get(path, {})) != path:
            problems.append(f"agent: {path} is not mounted from the host")
    run_dir = os.path.dirname(cfg.agent.worker_socket)
    if _host_path(mounts.get(run_dir, {})) != run_dir:
        problems.append(f"agent: {run_dir} is not the host's shared directory")
    return problems


def worker_problems(docs, cfg: Config) -> list[str]:
    pod, c, problems = _common_problems(docs, "worker", _port(cfg.worker.listen))
    agent_pod = docs[("DaemonSet", "turbonode-agent")]["spec"]["template"]["spec"]
    run_dir = os.path.dirname(cfg.worker.control_socket)
    if _host_path(_mounts(c, pod).get(run_dir, {})) != run_dir:
        problems.append(f"worker: {run_dir} is not shared with the agent through the host")
    svc = docs[("Service", "turbonode-worker")]
    if svc["spec"]["selector"] != docs[("DaemonSet", "turbonode-worker")]["spec"]["selector"]["matchLabels"]:
        problems.append("worker: the Service does not select the worker pods")
    if "nvidia.com/gpu" not in c["resources"]["limits"]:
        problems.append("worker: no GPU requested")
    group = pod["securityContext"]["runAsGroup"]
    if agent_pod["containers"][0]["securityContext"].get("runAsGroup") != group:
        problems.append(f"worker: the agent does not run with the control socket's group {group}")
    if pod["terminationGracePeriodSeconds"] < 60:
        problems.append("worker: too little grace to drain in-flight jobs")
    probes = {kind: c.get(kind, {}).get("httpGet", {}).get("path") for kind in ("livenessProbe", "readinessProbe")}
    if probes != {"livenessProbe": "/livez", "readinessProbe": "/readyz"}:
        problems.append(f"worker: probes {probes} (want liveness /livez, readiness /readyz)")
    return problems


def node_label_problems(docs) -> list[str]:
    """Both daemons of a node must label their metrics with the same `node`: the Kubernetes node."""
    problems = []
    for role in ("agent", "worker"):
        c = docs[("DaemonSet", f"turbonode-{role}")]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env.get("TURBONODE_NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if ref != "spec.nodeName":
            problems.append(f"{role}: TURBONODE_NODE_NAME is not the pod's spec.nodeName")
    return problems


def test_every_manifest_parses_and_is_listed():
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = manifests()
    assert {k for k, _ in docs} == {"Namespace", "ConfigMap", "DaemonSet", "Service"}
    for (kind, name), doc in docs.items():
        assert doc["apiVersion"] and (kind == "Namespace" or doc["metadata"]["namespace"] == "turbonode"), name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds():
    res = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert len(list(yaml.safe_load_all(res.stdout))) == len(manifests())


def test_configmap_toml_is_valid(tmp_path):
    docs = manifests()
    toml = tmp_path / "turbonode.toml"
    toml.write_text(docs[("ConfigMap", "turbonode-config")]["data"]["turbonode.toml"])
    cfg = load_config(str(toml), env={})
    assert cfg.agent.worker_socket == cfg.worker.control_socket
    assert config_problems(docs) == []
    assert agent_problems(docs, cfg) == []
    assert worker_problems(docs, cfg) == []
    assert node_label_problems(docs) == []
    # the variable the manifests set is the configuration key node.name
    assert load_config(os.devnull, env={"TURBONODE_NODE_NAME": "gpu-node-01"}).node.name == "gpu-node-01"


def test_checks_catch_broken_manifests():
    docs, cfg = manifests(), Config()
    broken = copy.deepcopy(docs)
    agent = broken[("DaemonSet", "turbonode-agent")]["spec"]["template"]["spec"]
    agent["hostNetwork"] = False
    agent["containers"][0]["securityContext"]["capabilities"]["add"].remove("BPF")
    agent["containers"][0]["env"] = []  # procfs falls back to /proc, which is the container's own
    worker = broken[("DaemonSet", "turbonode-worker")]["spec"]["template"]["spec"]
    worker["volumes"] = [v for v in worker["volumes"] if v["name"] != "run"] + [{"name": "run", "emptyDir": {}}]
    worker["containers"][0]["ports"][0]["containerPort"] = 8000
    worker["containers"][0]["command"][-1] = "/etc/other.toml"
    worker["containers"][0]["readinessProbe"]["httpGet"]["path"] = "/healthz"
    worker["containers"][0]["env"] = [e for e in worker["containers"][0]["env"] if e["name"] != "TURBONODE_NODE_NAME"]
    problems = (
        agent_problems(broken, cfg)
        + worker_problems(broken, cfg)
        + config_problems(broken)
        + node_label_problems(broken)
    )
    for expected in (
        "hostNetwork",
        "capabilities",
        "procfs root",
        "/run/turbonode is not shared",
        "worker: port is not 8460",
        "--config /etc/other.toml",
        "want liveness /livez, readiness /readyz",
        "worker: TURBONODE_NODE_NAME",
    ):
        assert any(expected in p for p in problems), (expected, problems)


def test_image_ids_match_the_manifests():
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    pod = manifests()[("DaemonSet", "turbonode-worker")]["spec"]["template"]["spec"]
    assert re.search(rf"--gid {pod['securityContext']['runAsGroup']} turbonode\b", dockerfile)
    assert re.search(rf"--uid {pod['securityContext']['runAsUser']} .*turbonode-worker", dockerfile, re.S)
