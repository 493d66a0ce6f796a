"""The import rules of the layout (README, "Where things are"), checked on the source and in a
fresh interpreter: which project packages each package may import, click only in the CLI, the
agent's side never loading torch, and the worker's two processes (render/front and
render/accounts, render/engine, and what both share at the top of render/) apart."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import (every import, lazy ones included)
MAY_IMPORT: dict[str, set[str]] = {
    "turbonode": set(),
    "bpf": set(),
    "tc": {"turbonode", "bpf"},
    "agent": {"turbonode", "tc", "bpf"},
    "render": {"turbonode"},
    "sandbox": {"turbonode", "tc"},
    "turboctl": {"turbonode", "tc", "bpf", "agent", "render", "sandbox"},
}
PROJECT = set(MAY_IMPORT) | {"tests", "bench"}


def _imports(path: Path, package: str) -> set[str]:
    """Top-level names of every module `path` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    parts = path.relative_to(ROOT).with_suffix("").parts
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add((parts[: -node.level] or (package,))[0])
            elif node.module:
                names.add(node.module.split(".")[0])
    return names


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_package_imports_only_what_it_may(package):
    wrong = {}
    for path in _sources(package):
        bad = (_imports(path, package) & PROJECT) - MAY_IMPORT[package] - {package}
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"{package} may import only {sorted(MAY_IMPORT[package])} of the project: {wrong}"


def test_agent_and_render_never_import_each_other():
    assert "render" not in MAY_IMPORT["agent"] and "agent" not in MAY_IMPORT["render"]
    for package, other in (("agent", "render"), ("render", "agent")):
        assert not [p for p in _sources(package) if other in _imports(p, package)]


def test_only_the_cli_imports_click():
    users = [
        str(p.relative_to(ROOT))
        for package in MAY_IMPORT
        if package != "turboctl"
        for p in _sources(package)
        if "click" in _imports(p, package)
    ]
    assert not users, f"click outside turboctl/: {users}"


def test_the_rules_see_real_imports():
    """The checker itself: it finds absolute, relative and lazy imports."""
    assert {"turbonode", "tc"} <= _imports(ROOT / "agent" / "daemon.py", "agent")  # lazy: from tc.datapath
    assert "agent" in _imports(ROOT / "agent" / "loop.py", "agent")  # relative: from .policy
    assert "click" in _imports(ROOT / "turboctl" / "__init__.py", "turboctl")


AGENT_SIDE = [
    "agent.daemon",
    "agent.loop",
    "agent.policy",
    "agent.actuator",
    "agent.metrics",
    "agent.mounts",
    *[f"agent.watchers.{p.stem}" for p in sorted((ROOT / "agent" / "watchers").glob("[a-z]*.py"))],
    "tc.datapath",
    "tc.classifier",
    "sandbox.demo",
    "sandbox.traffic",
    "sandbox.loadgen",
    "turboctl",
    *[".".join(p.relative_to(ROOT).with_suffix("").parts) for p in sorted((ROOT / "turbonode").rglob("[a-z]*.py"))],
]


def _loads_none_of(modules: list[str], never: list[str], timeout: float) -> None:
    """Import `modules` in a fresh interpreter: none of `never` (or a module inside one) is loaded."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"never = {never!r}\n"
        "bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in never))\n"
        "sys.exit(f'imported {bad}' if bad else 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_importing_the_agent_side_never_imports_torch():
    _loads_none_of(AGENT_SIDE, ["diffusers", "render", "torch"], timeout=120)


def test_the_distribution_and_the_image_ship_every_package():
    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = {p.removesuffix("*") for p in include}
    assert shipped == set(MAY_IMPORT)
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M))
    assert shipped <= copied, f"deploy/Dockerfile does not copy {sorted(shipped - copied)}"


def _module_names() -> dict[str, Path]:
    """Dotted name -> source of every module of the shipped packages."""
    names = {}
    for package in MAY_IMPORT:
        for path in _sources(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (every import, lazy and TYPE_CHECKING ones included):
    `from a import b` is a.b where a.b is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p)
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_module_imports_itself_round_a_cycle():
    """A cycle (a imports b imports a, even lazily or for typing) means the two are one module
    split in the wrong place: a maintainer cannot read either alone."""
    modules = _module_names()
    graph = {name: _module_imports(name, path, modules) for name, path in modules.items()}
    cycles = set()
    for start in graph:
        stack = [(start, (start,))]
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.add(" -> ".join(sorted(trail)))
                elif nxt not in trail and nxt > start:  # each cycle once, from its smallest module
                    stack.append((nxt, (*trail, nxt)))
    assert not cycles, f"import cycles: {sorted(cycles)}"


# The worker's two processes (docs/worker.md, "Two processes"): the packages that run in each, and
# what neither they nor the modules both share (render/*.py) may import, even lazily.
PROCESSES: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "front": (("render.front", "render.accounts"), frozenset({"torch", "diffusers", "transformers", "render.engine"})),
    "engine": (
        ("render.engine",),
        frozenset({"aiohttp", "prometheus_client", "redis", "render.front", "render.accounts"}),
    ),
}
SHARED = sorted(f"render.{p.stem}" for p in (ROOT / "render").glob("[a-z]*.py"))


def _process_modules(process: str) -> dict[str, Path]:
    """The modules that run in `process`: its packages' and the shared ones."""
    packages = PROCESSES[process][0]
    return {
        name: path
        for name, path in _module_names().items()
        if name in SHARED or any(name == p or name.startswith(p + ".") for p in packages)
    }


def _dotted_imports(name: str, path: Path) -> set[str]:
    """Every module name `name` imports, in full (`from a import b` gives a and a.b), relative
    imports resolved, lazy and TYPE_CHECKING ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p)
            found |= {source, *(f"{source}.{a.name}" for a in node.names)}
    return found


def _forbidden(names, process: str) -> list[str]:
    never = PROCESSES[process][1]
    return sorted({n for n in names if any(n == f or n.startswith(f + ".") for f in never)})


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_each_worker_process_imports_nothing_of_the_other_in_its_source(process):
    modules = _process_modules(process)
    assert {"render.link", "render.jobs"} <= modules.keys() and len(modules) > len(SHARED)
    wrong = {}
    for name, path in modules.items():
        bad = _forbidden(_dotted_imports(name, path), process)
        if bad:
            wrong[name] = bad
    assert not wrong, f"the {process} process never imports {sorted(PROCESSES[process][1])}: {wrong}"


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_importing_each_worker_process_loads_nothing_of_the_other(process):
    _loads_none_of(sorted(_process_modules(process)), sorted(PROCESSES[process][1]), timeout=300)


def test_the_process_rules_see_real_imports():
    """The checker itself: a lazy import and a relative one across packages are seen in full."""
    host = _dotted_imports("render.engine.host", ROOT / "render" / "engine" / "host.py")
    assert {"torch", "render.engine.scheduler", "render.link"} <= host  # lazy, relative, absolute
    assert _forbidden({"render.engine.scheduler", "torch.cuda", "render.jobs"}, "front") == [
        "render.engine.scheduler",
        "torch.cuda",
    ]
