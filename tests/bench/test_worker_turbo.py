"""bench/worker_turbo.py stops every worker it started, also when a later one fails to start."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import worker_turbo


def test_a_worker_that_fails_to_start_leaves_none_running():
    stopped: list[str] = []

    class Started:
        def __init__(self, tree: Path):
            self.tree = tree

        def stop(self) -> None:
            stopped.append(self.tree.name)

    def start(tree: Path, _scratch: Path):
        if tree.name == "broken":
            raise OSError("cannot start python")  # e.g. Popen's failure, before any worker runs
        return Started(tree)

    with pytest.raises(OSError):
        worker_turbo.run([Path("/a/main"), Path("/b/other"), Path("/c/broken")], 10, 1, start=start)
    assert stopped == ["other", "main"]
