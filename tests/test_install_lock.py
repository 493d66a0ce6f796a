"""The locked install: requirements.lock covers pyproject.toml, carries hashes, and is what is installed.

scripts/setup.sh installs the lock (hashes checked) after torch's CPU wheel, so every machine
runs the suite on the same dependency set; scripts/lock.sh regenerates it (docs/cli.md, setup).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _lock() -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) for each pin of requirements.lock."""
    pins: dict[str, tuple[str, int]] = {}
    name = None
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if m := PIN.match(line):
            name = canonicalize_name(m[1])
            pins[name] = (m[2], 0)
        elif line.strip().startswith("--hash=sha256:") and name is not None:
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
    return pins


def _torch_version() -> str:
    m = re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / "scripts/versions.sh").read_text(), re.M)
    assert m, "scripts/versions.sh defines no TORCH_VERSION"
    return m[1]


def _requirements() -> list[Requirement]:
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in (*project["dependencies"], *extras["worker"], *extras["test"])]


def test_the_lock_pins_every_requirement_of_pyproject_within_its_range():
    pins = _lock()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            assert req.specifier.contains(_torch_version()), f"scripts/versions.sh's torch is outside {req}"
            assert name not in pins, "torch is installed apart from the lock (its CPU wheel)"
            continue
        assert name in pins, f"{req.name} is not in requirements.lock: run bash scripts/lock.sh"
        assert req.specifier.contains(pins[name][0], prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[name][0]} outside {req}: run bash scripts/lock.sh"
        )


def test_every_pin_is_hashed_and_the_lock_is_resolved_for_torchs_cpu_wheel():
    pins = _lock()
    assert len(pins) > 20
    assert not [n for n, (_, hashes) in pins.items() if hashes == 0]
    # PyPI's torch for Linux depends on CUDA's wheels; the CPU wheel does not
    assert not [n for n in pins if n.startswith(("nvidia-", "cuda-")) and n != "nvidia-ml-py" or n == "triton"]
    torch_metadata = _pyproject()["tool"]["uv"]["dependency-metadata"]
    assert [m["version"] for m in torch_metadata if m["name"] == "torch"] == [_torch_version()]


def test_the_installed_environment_is_the_locked_one():
    """A venv built before the lock changed (an older machine's) differs from a newcomer's: say which."""
    drift = []
    for name, (version, _) in _lock().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            drift.append(f"{name}: locked {version}, installed {installed}")
    assert not drift, "the venv is not the locked set (rerun bash scripts/setup.sh):\n" + "\n".join(drift)
    assert metadata.version("torch").split("+")[0] == _torch_version()
