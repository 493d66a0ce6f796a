"""Fixtures shared by the tests of more than one folder, requested by name. Kernel tests run for
real as root; they skip only where the machine cannot (the marks are in tests/helpers.py)."""

from __future__ import annotations

import pytest

from tests.helpers import KERNEL_SKIP, MiniWorker


@pytest.fixture
def sandbox():
    """Two fresh network namespaces joined by veth, deleted afterwards (also on failure)."""
    if KERNEL_SKIP:
        pytest.skip(KERNEL_SKIP)
    from sandbox.netns import Sandbox

    with Sandbox() as sb:
        yield sb


@pytest.fixture
def worker(tmp_path):
    """The agent's stand-in for a worker (MiniWorker), serving its control socket at tmp_path/worker.sock."""
    w = MiniWorker()
    srv = w.serve(str(tmp_path / "worker.sock"))
    yield w
    srv.close()
