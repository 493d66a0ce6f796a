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

import pytest
import yaml

from tests.helpers import ROOT
from turbonode.config import Config, load_config, node_workers

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
    for (kind, _name), ds in docs.items():
        if kind != "DaemonSet":
            continue
        pod = ds["spec"]["template"]["spec"]
        for c in pod["containers"]:
            mounts = _mounts(c, pod)
            cfg_path = c["command"][c["command"].index("--config") + 1]
            vol = mounts.get(os.path.dirname(cfg_path), {})
            if (
                vol.get("configMap", {}).get("name") != cm["metadata"]["name"]
                or os.path.basename(cfg_path) not in cm["data"]
            ):
                problems.append(f"{c['name']}: --config {cfg_path} is not the ConfigMap's file")
    return problems


def _common_problems(c: dict, role: str, port: int, port_name: str) -> list[str]:
    """What is wrong with a container's command and port (named so that Prometheus scrapes it)."""
    problems = []
    if c["command"][:3] != ["turboctl", role, "run"]:
        problems.append(f"{c['name']}: command {c['command']}")
    if [(p["name"], p["containerPort"]) for p in c["ports"]] != [(port_name, port)]:
        problems.append(f"{c['name']}: port is not {port_name} {port}")
    return problems


def agent_problems(docs, cfg: Config) -> list[str]:
    pod = docs[("DaemonSet", "turbonode-agent")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    problems = _common_problems(c, "agent", _port(cfg.agent.metrics), "metrics")
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
    for spec in node_workers(cfg):
        run_dir = os.path.dirname(spec.control_socket)
        if _host_path(mounts.get(run_dir, {})) != run_dir:
            problems.append(f"agent: {run_dir} (worker {spec.name}'s socket) is not the host's shared directory")
    nvidia = {e["name"]: e.get("value") for e in c.get("env", [])}
    if nvidia.get("NVIDIA_VISIBLE_DEVICES") != "all" or "utility" not in (
        nvidia.get("NVIDIA_DRIVER_CAPABILITIES") or ""
    ):
        problems.append("agent: no NVML for the node's GPUs (NVIDIA_VISIBLE_DEVICES=all, capability utility)")
    return problems


def worker_problems(docs, cfg: Config) -> list[str]:
    """One container per worker the configuration names, each its instance, port, probes and GPU."""
    ds = docs[("DaemonSet", "turbonode-worker")]
    pod = ds["spec"]["template"]["spec"]
    agent_pod = docs[("DaemonSet", "turbonode-agent")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    specs = node_workers(cfg)
    problems = []
    if sorted(containers) != sorted(f"worker-{s.name}" for s in specs):
        problems.append(f"worker: containers {sorted(containers)} are not the configuration's workers")
    svc_ports = {p["name"]: p["port"] for p in docs[("Service", "turbonode-worker")]["spec"]["ports"]}
    for spec in specs:
        c = containers.get(f"worker-{spec.name}")
        if c is None:
            continue
        name = f"http-{spec.name}"
        problems += _common_problems(c, "worker", _port(spec.listen), name)
        if c["command"][c["command"].index("--instance") + 1 :][:1] != [spec.name]:
            problems.append(f"{c['name']}: not run as --instance {spec.name}")
        if svc_ports.get(name) != _port(spec.listen):
            problems.append(f"{c['name']}: the Service has no port {name}")
        run_dir = os.path.dirname(spec.control_socket)
        if _host_path(_mounts(c, pod).get(run_dir, {})) != run_dir:
            problems.append(f"{c['name']}: {run_dir} is not shared with the agent through the host")
        if c["resources"]["limits"].get("nvidia.com/gpu") != 1:
            problems.append(f"{c['name']}: not one GPU of its own")
        probes = {kind: c.get(kind, {}).get("httpGet", {}) for kind in ("livenessProbe", "readinessProbe")}
        if {k: (p.get("path"), p.get("port")) for k, p in probes.items()} != {
            "livenessProbe": ("/livez", name),
            "readinessProbe": ("/readyz", name),
        }:
            problems.append(f"{c['name']}: probes {probes} (want liveness /livez, readiness /readyz on {name})")
    svc = docs[("Service", "turbonode-worker")]
    if svc["spec"]["selector"] != ds["spec"]["selector"]["matchLabels"]:
        problems.append("worker: the Service does not select the worker pods")
    group = pod["securityContext"]["runAsGroup"]
    if agent_pod["containers"][0]["securityContext"].get("runAsGroup") != group:
        problems.append(f"worker: the agent does not run with the control socket's group {group}")
    if pod["terminationGracePeriodSeconds"] < 60:
        problems.append("worker: too little grace to drain in-flight jobs")
    return problems


def node_label_problems(docs) -> list[str]:
    """Both daemons of a node must label their metrics with the same `node`: the Kubernetes node."""
    problems = []
    for role in ("agent", "worker"):
        for c in docs[("DaemonSet", f"turbonode-{role}")]["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            ref = env.get("TURBONODE_NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref != "spec.nodeName":
                problems.append(f"{c['name']}: TURBONODE_NODE_NAME is not the pod's spec.nodeName")
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


def configmap_config(docs, tmp_path) -> Config:
    """The configuration both daemons load from the ConfigMap, with the real loader."""
    toml = tmp_path / "turbonode.toml"
    toml.write_text(docs[("ConfigMap", "turbonode-config")]["data"]["turbonode.toml"])
    return load_config(str(toml), env={})


def test_configmap_toml_is_valid(tmp_path):
    docs = manifests()
    cfg = configmap_config(docs, tmp_path)
    assert [s.name for s in node_workers(cfg)] == ["gpu0", "gpu1", "gpu2", "gpu3"]  # one per GPU container
    assert config_problems(docs) == []
    assert agent_problems(docs, cfg) == []
    assert worker_problems(docs, cfg) == []
    assert node_label_problems(docs) == []
    # the variable the manifests set is the configuration key node.name
    assert load_config(os.devnull, env={"TURBONODE_NODE_NAME": "gpu-node-01"}).node.name == "gpu-node-01"


def test_checks_catch_broken_manifests(tmp_path):
    docs = manifests()
    cfg = configmap_config(docs, tmp_path)
    broken = copy.deepcopy(docs)
    agent = broken[("DaemonSet", "turbonode-agent")]["spec"]["template"]["spec"]
    agent["hostNetwork"] = False
    agent["containers"][0]["securityContext"]["capabilities"]["add"].remove("BPF")
    agent["containers"][0]["env"] = []  # procfs falls back to /proc (the container's own), and no NVML
    worker = broken[("DaemonSet", "turbonode-worker")]["spec"]["template"]["spec"]
    worker["volumes"] = [v for v in worker["volumes"] if v["name"] != "run"] + [{"name": "run", "emptyDir": {}}]
    worker["containers"][0]["ports"][0]["containerPort"] = 8000
    worker["containers"][0]["command"][4] = "/etc/other.toml"
    worker["containers"][0]["readinessProbe"]["httpGet"]["path"] = "/healthz"
    worker["containers"][0]["env"] = [e for e in worker["containers"][0]["env"] if e["name"] != "TURBONODE_NODE_NAME"]
    worker["containers"][1]["command"][-1] = "gpu0"  # two containers for one worker
    worker["containers"][2]["resources"]["limits"].pop("nvidia.com/gpu")
    del worker["containers"][3]
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
        "no NVML",
        "/run/turbonode is not shared",
        "worker-gpu0: port is not http-gpu0 8460",
        "--config /etc/other.toml",
        "want liveness /livez, readiness /readyz",
        "worker-gpu0: TURBONODE_NODE_NAME",
        "worker-gpu1: not run as --instance gpu1",
        "worker-gpu2: not one GPU of its own",
        "are not the configuration's workers",
    ):
        assert any(expected in p for p in problems), (expected, problems)


def test_image_ids_match_the_manifests():
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    pod = manifests()[("DaemonSet", "turbonode-worker")]["spec"]["template"]["spec"]
    assert re.search(rf"--gid {pod['securityContext']['runAsGroup']} turbonode\b", dockerfile)
    assert re.search(rf"--uid {pod['securityContext']['runAsUser']} .*turbonode-worker", dockerfile, re.S)
