"""render/front/priority.py: the front's threads yield the CPU to the engine process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from render.front.priority import front_nice, yield_to_engine
from tests.helpers import ROOT
from turbonode.config.worker import FRONT_NICE_AUTO, SHARED_CPU_NICE

CHILD = textwrap.dedent("""
    import json, os, sys, threading
    from render.front.priority import yield_to_engine
    done = threading.Event()
    before = threading.Thread(target=done.wait)
    before.start()  # a thread that exists when the front yields
    kept = threading.Thread(target=done.wait)
    kept.start()  # one it leaves alone (the full collections' thread)
    engine = os.fork()  # stands for the engine process, spawned before the front yields
    if engine == 0:
        done.wait(30)
        os._exit(0)
    problems = yield_to_engine(int(sys.argv[1]), keep=(kept.native_id,))
    after = threading.Thread(target=done.wait)
    after.start()  # started later: inherits the value
    nices = {t: os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{os.getpid()}/task")}
    print(json.dumps({"problems": problems, "threads": nices, "engine": os.getpriority(os.PRIO_PROCESS, engine),
                      "after": after.native_id, "kept": kept.native_id}))
    done.set()
    os.kill(engine, 9)
    os.waitpid(engine, 0)
""")


def run_child(nice: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(nice)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout)


def test_every_thread_of_the_front_yields_and_the_engine_keeps_its_nice():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    got = run_child(base + 7)
    assert got["problems"] == []
    assert got["threads"].pop(str(got["kept"])) == base  # the thread kept out keeps its nice
    assert len(got["threads"]) == 3 and set(got["threads"].values()) == {base + 7}
    assert str(got["after"]) in got["threads"]
    assert got["engine"] == base


def test_zero_changes_nothing():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    got = run_child(0)
    assert set(got["threads"].values()) == {base} and got["engine"] == base


def test_a_missing_procfs_is_named(tmp_path):
    (problem,) = yield_to_engine(5, procfs=str(tmp_path))
    assert "cannot list this process's threads" in problem and str(tmp_path) in problem


def test_the_default_yields_only_where_front_and_engine_share_one_cpu():
    assert front_nice(FRONT_NICE_AUTO, 1) == SHARED_CPU_NICE > 0  # a pinned worker of a multi-GPU node
    assert front_nice(FRONT_NICE_AUTO, 2) == 0 == front_nice(FRONT_NICE_AUTO, 64)  # side by side
    assert front_nice(0, 1) == 0 and front_nice(10, 8) == 10  # a value set is kept
