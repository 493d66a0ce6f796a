"""`lock_memory` in the worker's throttle (the agent's memory_protect lever): both worker processes
lock their pages while it lasts and unlock when it is released or expires (a dead agent's lock
lapses with its lease); a bad value is refused; MemoryLock alone in this process."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from bench.node import wait_for
from render.memory_lock import MemoryLock
from tests.render.helpers import kill_worker, start_worker
from turbonode.errors import ControlError
from turbonode.jsonrpc import ControlClient


def locked_kib(pid: int | str) -> int:
    """VmLck of a process: the size of its locked mappings."""
    return int(re.search(r"^VmLck:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def test_memory_lock_locks_this_process_and_unlocks_it():
    lock = MemoryLock("test")
    assert locked_kib("self") == 0
    lock.apply(True)
    try:
        if lock.error:
            pytest.skip(f"cannot lock here: {lock.error}")
        assert lock.locked and locked_kib("self") > 0
        lock.apply(True)  # idempotent
    finally:
        lock.apply(False)
    assert not lock.locked and locked_kib("self") == 0 and lock.status() == {"locked": False, "error": None}


@pytest.mark.slow
def test_the_worker_locks_both_processes_while_its_throttle_asks_and_unlocks_after(tmp_path):
    proc, _, control, engine = start_worker(tmp_path)
    client = ControlClient(control)
    pids = (proc.pid, engine.pid)
    try:
        assert [locked_kib(p) for p in pids] == [0, 0]
        with pytest.raises(ControlError, match="lock_memory must be true or false"):
            client.call("throttle", reason="x", ttl_s=1.0, lock_memory="yes")
        client.call("throttle", reason="memory pressure", ttl_s=2.0, lock_memory=True)
        assert wait_for(lambda: all(locked_kib(p) > 0 for p in pids), 5), [locked_kib(p) for p in pids]
        both = {"front": {"locked": True, "error": None}, "engine": {"locked": True, "error": None}}
        # the engine's part comes from its last snapshot (a moment behind)
        assert wait_for(lambda: client.call("status")["memory"]["lock"] == both, 5), client.call("status")
        assert client.call("status")["throttle"]["lock_memory"] is True
        client.call("release", reason="recovered")  # released: both unlock
        assert wait_for(lambda: all(locked_kib(p) == 0 for p in pids), 5), [locked_kib(p) for p in pids]
        client.call("throttle", reason="memory pressure", ttl_s=1.0, lock_memory=True)
        assert wait_for(lambda: all(locked_kib(p) > 0 for p in pids), 5)
        time.sleep(1.0)  # nobody renews it (a dead agent): it expires, and the lock with it
        assert wait_for(lambda: all(locked_kib(p) == 0 for p in pids), 5), [locked_kib(p) for p in pids]
    finally:
        kill_worker(proc)
