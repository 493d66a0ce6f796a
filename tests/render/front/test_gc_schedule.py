"""render/front/gc_schedule.py: the front's collections wait while a turbo request is handled."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

import pytest

from render.front.gc_schedule import GcSchedule, due_generation
from render.gc_telemetry import GcMonitor
from tests.render.helpers import post, serve


@pytest.fixture(scope="module")
def server():
    with serve() as s:
        yield s


def test_the_due_generation_is_cpythons():
    assert due_generation((700, 0, 0), (700, 10, 10)) is None  # not past the threshold yet
    assert due_generation((701, 0, 0), (700, 10, 10)) == 0
    assert due_generation((701, 11, 0), (700, 10, 10)) == 1
    assert due_generation((701, 11, 11), (700, 10, 10)) == 2
    assert due_generation((10**6, 0, 0), (0, 10, 10)) is None  # gc.set_threshold(0): collection off


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def garbage(n: int = 2000) -> None:
    for _ in range(n):
        a: dict = {}
        a["self"] = a  # a cycle: counted until a collection frees it


def test_a_due_collection_waits_for_the_turbo_request_then_runs():
    clock = Clock()
    schedule = GcSchedule(max_defer_s=0.5, clock=clock)
    monitor = GcMonitor().install()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        before = monitor.collections_total
        with schedule.protecting():
            garbage()
            assert schedule.tick() is None and schedule.deferred == 1  # due, deferred
            assert monitor.collections_total == before
            clock.now = 0.6  # deferred past max_defer_s: collected anyway
            garbage()
            assert schedule.tick() == 0 and schedule.forced == 1
        garbage()
        assert schedule.tick() == 0  # nothing protected: collected at once
        assert monitor.collections_total == before + 2  # timed as every collection is
    finally:
        monitor.uninstall()
        if was:
            gc.enable()


def test_the_loop_turns_automatic_collection_off_and_back_on():
    async def main() -> bool:
        task = asyncio.create_task(GcSchedule(interval_s=0.001).run())
        await asyncio.sleep(0.01)
        off = not gc.isenabled()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return off

    assert asyncio.run(main()) and gc.isenabled()


class Seen(GcSchedule):
    """Records the protected count at each request's end (the collection it would have deferred)."""

    def __init__(self):
        super().__init__()
        self.held: list[int] = []

    @contextlib.contextmanager
    def protecting(self) -> Iterator[None]:
        with super().protecting():
            yield
            self.held.append(self.protected)


def test_a_turbo_request_is_protected_until_answered_and_other_tiers_are_not(server):
    seen = server.api.gc_schedule = Seen()
    try:
        for tier in ("turbo", "relax", "fast", "turbo"):
            assert post(server.url, {"prompt": "x", "size": "64x64", "steps": 1, "tier": tier})[0] == 200
        assert seen.held == [1, 1] and seen.protected == 0
        assert post(server.url, {"prompt": " ", "tier": "turbo"})[0] == 400  # refused before its tier is granted
        assert seen.held == [1, 1] and seen.protected == 0
    finally:
        server.api.gc_schedule = None
