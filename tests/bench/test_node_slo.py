"""bench/node_slo.py --workers: which worker each cell's verdict judges (issue 22's targets)."""

from __future__ import annotations

from bench.node_slo import report_workers


def _worker(p99_s: float, reasons: list[str]) -> tuple[dict, dict]:
    figures = {"tiers": {"turbo": {"ok": 100, "p50_s": p99_s / 2, "p99_s": p99_s, "max_s": p99_s}}}
    seen = {
        "max_level": "pressured" if reasons else "normal",
        "reasons": reasons,
        "throttled_share": 1.0 if reasons else 0.0,
        "levers": {},
    }
    return figures, seen


def _result(p99: dict[str, dict[str, float]], reasons: dict[str, dict[str, list[str]]]) -> dict:
    cells = {}
    for cell, by_worker in p99.items():
        made = {name: _worker(v, reasons.get(cell, {}).get(name, [])) for name, v in by_worker.items()}
        cells[cell] = {
            "turbonode": {
                "workers": {name: figures for name, (figures, _) in made.items()},
                "agent": {"workers": {name: seen for name, (_, seen) in made.items()}},
            }
        }
    return {"cells": cells, "modes": ["turbonode"], "knobs": {}, "loadavg_before": [0, 0, 0]}


def test_a_own_faults_in_all_are_shown_apart_and_the_others_judged_against_2x():
    text = report_workers(
        _result(
            {
                "none": {"a": 0.4, "b": 0.4},
                "gc": {"a": 0.84, "b": 0.42},
                "cpu-bulk": {"a": 0.41, "b": 0.36},
                "all": {"a": 1.1, "b": 0.9},
            },
            {"gc": {"a": ["cpu_load", "gc_pause_s"], "b": ["cpu_load"]}},
        )
    )
    assert "every other worker's p99 <= 1.1 x its none: b 1.05x - met" in text
    assert "a throttled 100% (cpu_load, gc_pause_s - its own), b throttled 100% (cpu_load)" in text
    # cpu-bulk for both, `all` for b (a's faults are not b's): 3 verdicts; b's 2.25x in `all` misses
    assert "every worker's p99 <= 2 x its none: met in 2/3; missed: all/b 2.25x" in text
    assert "with a's own faults too (no target: gc, relax-flood are a's, not the node's): all/a 2.75x" in text


# ---- SLO attainment (bench/slo.py): the share of a tier's requests within its objective --------

from bench import slo  # noqa: E402
from bench.fleet_slo import report as fleet_report  # noqa: E402
from bench.fleet_slo import result_record as fleet_record  # noqa: E402
from bench.node_slo import report, result_record  # noqa: E402


def _outcome(tier: str, status: int, latency: float) -> dict:
    return {"tier": tier, "status": status, "latency": latency, "connect_s": 0.0, "elapsed_s": latency / 2}


def test_refusals_and_errors_count_as_misses():
    turbo = slo.OBJECTIVE_S["turbo"]
    outcomes = (
        [_outcome("turbo", 200, turbo / 2)] * 996
        + [_outcome("turbo", 200, turbo + 0.1)]  # answered, too late
        + [_outcome("turbo", 503, 0.01), _outcome("turbo", 429, 0.01)]  # refused at once: not a pass
        + [_outcome("turbo", 0, 30.0)]  # no answer
    )
    a = slo.attainment(outcomes, "turbo")
    assert (a["requests"], a["within"], a["refused"], a["errors"]) == (1000, 996, 2, 1)
    assert a["attainment"] == 0.996 and a["met"] is False and a["target"] == 0.999
    assert slo.pct(a) == "99.6%"


def test_a_tier_without_requests_has_no_attainment_not_100_percent():
    a = slo.attainment([_outcome("turbo", 200, 0.1)], "fast")
    assert a["requests"] == 0 and a["attainment"] is None and a["met"] is None
    assert slo.pct(a) == "none"
    v = slo.verdict({"none": {"turbo": slo.attainment([], "turbo"), "fast": a}})
    assert v["turbo"]["met"] is None and v["turbo"]["no_requests"] == ["none"]
    assert "turbo >= 99.9% within 2 s: no requests" in slo.verdict_line(v)


def test_the_objectives_are_the_workers_own_turbo_one():
    from turbonode.config import WorkerConfig

    assert slo.OBJECTIVE_S["turbo"] == WorkerConfig().slo["turbo"]
    assert slo.TARGET == {"turbo": 0.999, "fast": 0.99}


def _node_cell(turbo: list[dict], fast: list[dict]) -> dict:
    outcomes = turbo + fast
    ok = [o["latency"] for o in turbo if o["status"] == 200]
    return {
        "tiers": {
            "turbo": {
                "requests": len(turbo),
                "ok": len(ok),
                "rejected": sum(o["status"] in (429, 503) for o in turbo),
                "failed": sum(o["status"] not in (200, 429, 503) for o in turbo),
                "p50_s": sorted(ok)[len(ok) // 2],
                "p99_s": max(ok),
                "max_s": max(ok),
            },
        },
        "slo": slo.attainments(outcomes),
        "agent": None,
        "outcomes": outcomes,
    }


def _node_result() -> dict:
    fine = [_outcome("turbo", 200, 0.3)] * 100
    fast = [_outcome("fast", 200, 1.0)] * 50
    refused = [_outcome("turbo", 200, 0.3)] * 99 + [_outcome("turbo", 503, 0.01)]
    return {
        "cells": {
            "none": {"plain": _node_cell(fine, fast), "turbonode": _node_cell(fine, fast)},
            "cpu": {"plain": _node_cell(refused, []), "turbonode": _node_cell(refused, [])},
        },
        "modes": ["plain", "turbonode"],
        "knobs": {},
        "loadavg_before": [0, 0, 0],
        "requests": 100,
        "seed": 22,
    }


def test_node_slo_prints_attainment_per_tier_and_cell_beside_p50_p99():
    text = report(_node_result())
    header = text.splitlines()[1:3]
    assert "turboSLO" in header[1] and "fastSLO" in header[1] and header[1].index("p99") < header[1].index("turboSLO")
    cpu = next(line for line in text.splitlines() if line.startswith("cpu "))
    assert " 99.0% " in cpu and " none " in cpu  # a refusal is a miss; fast sent nothing there: none, not 100 %
    assert "turbo >= 99.9% within 2 s: MISSED in 1/2 cells (missed: cpu)" in text
    assert "fast >= 99.0% within 10 s: met in 1/1 cells; no requests in cpu" in text


def test_node_slo_record_keeps_attainment_per_cell_and_the_verdicts():
    r = result_record(_node_result())
    cols = r["table"]["columns"]
    rows = {(row[0], row[1]): dict(zip(cols, row)) for row in r["table"]["rows"]}
    assert rows[("cpu", "turbonode")]["turbo SLO"] == "99.0%" and rows[("cpu", "turbonode")]["fast SLO"] == "none"
    assert rows[("none", "turbonode")]["turbo SLO"] == "100.0%" and rows[("none", "turbonode")]["p99/ref"] == 1.0
    verdicts = {v["target"].split(" ")[0]: v for v in r["verdicts"]}
    assert verdicts["turbo"]["met"] is False and verdicts["turbo"]["value"] == "met in 1/2"
    assert verdicts["fast"]["met"] is True
    assert r["met"] is False and r["figures"]["lowest turbo SLO attainment (turbonode)"] == 0.99
    assert r["seed"] == 22 and r["n"] == 100


def test_one_worker_is_judged_at_1_2x_for_the_tail_beside_the_2x_node_target():
    result = _node_result()
    result["cells"]["cpu"]["turbonode"] = _node_cell(
        [_outcome("turbo", 200, 0.3)] * 99 + [_outcome("turbo", 200, 0.39)], []
    )
    text = report(result)
    assert "p99 <= 2 x none p99 (300 ms) = 600 ms: met in 2/2 cells" in text
    assert (
        "target tail: turbonode turbo p99 <= 1.2 x none p99 = 360 ms: met in 0/1 fault cells; missed: cpu 1.30x" in text
    )
    r = result_record(result)
    tail = next(v for v in r["verdicts"] if v["target"].endswith("(tail)"))
    assert tail["met"] is False and tail["value"] == "met in 0/1; missed cpu 1.30x" and r["met"] is False


def _fleet_cell(outcomes: list[dict]) -> dict:
    turbo = [o for o in outcomes if o["tier"] == "turbo"]
    ok = [o["latency"] for o in turbo if o["status"] == 200]
    att = slo.attainments(outcomes)
    return {
        "turbo": {
            "n": len(turbo),
            "ok": len(ok),
            "errors": len(turbo) - len(ok),
            "error_kinds": [],
            "p50_s": min(ok),
            "p99_s": max(ok),
            "max_s": max(ok),
            "attainment": att["turbo"]["attainment"],
        },
        "fast": {"n": 0, "attainment": att["fast"]["attainment"], "images_per_s": None},
        "relax_images_per_s": None,
        "slo": att,
        "windows": [],
        "retried": [],
        "restarts": [],
        "outcomes": outcomes,
    }


def test_fleet_slo_counts_errors_as_misses_and_says_none_for_an_empty_tier():
    result = {
        "cells": {
            "none": {"turbonode": _fleet_cell([_outcome("turbo", 200, 0.5)] * 300)},
            "rolling": {"turbonode": _fleet_cell([_outcome("turbo", 200, 0.6)] * 299 + [_outcome("turbo", 502, 0.2)])},
        },
        "nodes": 3,
        "cpus": 0.5,
        "rate": 1.5,
        "requests": 300,
        "loadavg_before": [0, 0, 0],
    }
    text = fleet_report(result)
    rolling = next(line for line in text.splitlines() if line.startswith("rolling"))
    assert "99.7%" in rolling and " none " in rolling
    assert "turbo >= 99.9% within 2 s: MISSED in 1/2 cells (missed: rolling)" in text
    assert "fast >= 99.0% within 10 s: no requests" in text
    r = fleet_record(result)
    assert r["figures"]["turbo SLO rolling"] == "99.7%" and r["figures"]["fast SLO none"] == "none"
    assert [v["met"] for v in r["verdicts"]] == [True, False, False, None] and r["met"] is False


# ---- the p99 ratios' bootstrap interval (bench/interval.py) ------------------------------------

from bench import interval  # noqa: E402
from bench.record import make, validate  # noqa: E402


def test_node_slo_prints_and_keeps_the_interval_beside_each_ratio():
    result = _node_result()
    text = report(result)
    assert interval.LABEL in text.splitlines()[1]
    none = next(line for line in text.splitlines() if line.startswith("none "))
    assert "1.00-1.00" in none
    r = result_record(result)
    rows = {(row[0], row[1]): dict(zip(r["table"]["columns"], row)) for row in r["table"]["rows"]}
    assert rows[("cpu", "turbonode")][f"p99/ref {interval.LABEL}"] == "1.00-1.00"
    assert rows[("cpu", "plain")][f"p99/ref {interval.LABEL}"] is None  # plain has no ratio
    assert f"(cpu, {interval.LABEL} 1.00-1.00)" in r["headline"]
    assert validate(make("node_slo", **r)) == []


def test_fleet_slo_gives_rolling_over_none_its_interval():
    result = {
        "cells": {
            "none": {"turbonode": _fleet_cell([_outcome("turbo", 200, 0.5)] * 300)},
            "rolling": {"turbonode": _fleet_cell([_outcome("turbo", 200, 0.6)] * 300)},
        },
        "nodes": 3,
        "cpus": 0.5,
        "rate": 1.5,
        "requests": 300,
        "loadavg_before": [0, 0, 0],
    }
    assert f"1.20x ({interval.LABEL} 1.20-1.20)" in fleet_report(result)
    r = fleet_record(result)
    assert r["figures"][f"rolling p99 / none p99 {interval.LABEL}"] == "1.20-1.20"
    assert validate(make("fleet_slo", **r)) == []


def test_a_run_bootstraps_each_pair_once_for_its_report_and_its_record():
    interval._bootstrap.cache_clear()
    result = _node_result()
    report(result)
    result_record(result)
    # none/none, cpu/none: bootstrapped by the report; the record finds both
    assert interval._bootstrap.cache_info().misses == 2


# ---- where turbo's time went: the stages of an answered request -----------------------------------

from bench.node_slo import STAGES  # noqa: E402


def test_the_engines_answer_time_is_split_from_the_fronts_part():
    # 2 s in all: 0.1 handshake, 1.0 engine, 0.3 answer made in the engine, 0.6 body; the front 0.0
    written = {"connect_s": 0.1, "elapsed_s": 1.0, "answer_s": 0.3, "first_byte_s": 1.4, "latency": 2.0}
    split = {name: round(stage(written), 6) for name, stage in STAGES.items()}
    assert split == {"connect": 0.1, "engine": 1.0, "answer": 0.3, "front": 0.0, "body": 0.6}
    # an answer the front wrote itself has no answer_s: its making stays in the front's part
    by_front = {**written, "answer_s": None}
    assert STAGES["answer"](by_front) == 0.0 and round(STAGES["front"](by_front), 6) == 0.3
    assert round(sum(stage(written) for stage in STAGES.values()), 6) == written["latency"]


# ---- --blocks: the cells in turn, several times, and each cell's blocks summarized together --------

import threading  # noqa: E402

from bench.node_slo import CellRun, block_plan, summarize_runs  # noqa: E402
from sandbox.loadgen import Outcome  # noqa: E402
from sandbox.node import AgentWatch  # noqa: E402


def test_blocks_share_out_the_requests_each_with_its_own_arrivals():
    assert block_plan(300, 1, 11) == [(300, 11)]  # one block: the run as before blocks
    assert block_plan(300, 3, 11) == [(100, 11), (100, 1011), (100, 2011)]
    assert block_plan(10, 3, None) == [(4, None), (3, None), (3, None)]


class _Agent:
    """An agent's control socket answering `status` with the next of its answers (then the last)."""

    def __init__(self, *answers: dict):
        self.answers = list(answers)
        self.polled = threading.Event()

    def call(self, method: str) -> dict:
        assert method == "status"
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        self.polled.set()
        return answer


def _watched(status: dict) -> AgentWatch:
    agent = _Agent(status)
    watch = AgentWatch(agent)  # type: ignore[arg-type]
    assert agent.polled.wait(5)
    watch.stop()
    return watch


def _counters(at: float, busy: float, exits: int, kills: int) -> dict:
    return {
        "at": at,
        "cpu_busy_s": busy,
        "batch_written": None,
        "stall_s": {"memory": at / 10, "io": 0.0},
        "major_faults": {},
        "worker_exits": exits,
        "oom_kills": {"batch": kills},
    }


def test_a_cells_blocks_are_summarized_together():
    quiet = {"level_index": 0, "active": [], "signals": {"cpu_load": 0.1}}
    loud = {
        "level_index": 2,
        "active": [{"signal": "gc_pause_s"}],
        "signals": {"cpu_load": 0.9},
        "actions": {"levers": {"cpu_share": {"engaged": True}}},
    }
    fast = [Outcome("turbo", 200, 0.3, connect_s=0.0, elapsed_s=0.2) for _ in range(99)]
    slow = [Outcome("turbo", 200, 0.9, connect_s=0.0, elapsed_s=0.5)]
    runs = [
        CellRun({"": (fast, 100.0)}, _watched(quiet), (_counters(0, 0, 0, 0), _counters(100, 150, 0, 1))),
        CellRun({"": (slow, 50.0)}, _watched(loud), (_counters(500, 900, 1, 1), _counters(550, 1000, 1, 3))),
    ]
    summarize_runs(runs[:1])  # after the first block, as the run logs it: changes none of the blocks
    r = summarize_runs(runs)
    assert r["agent"] == summarize_runs(runs)["agent"]  # each block's polls counted once, every time
    assert r["agent"]["signals_p50_p90"]["cpu_load"] == [0.1, 0.9]  # one poll of each block
    assert r["agent"]["levers"] == {"cpu_share": 0.5}  # the node's lever, engaged at one poll of two
    turbo = r["tiers"]["turbo"]
    assert turbo["requests"] == 100 and turbo["max_s"] == 0.9 and r["wall_s"] == 150.0
    assert len(r["outcomes"]) == 100
    # the agent: both blocks' polls (the highest level and every reason of either)
    assert r["agent"]["max_level"] != "normal" and r["agent"]["reasons"] == ["gc_pause_s"]
    # the node: over the blocks' 150 s, not the 550 s between the first's start and the last's end
    assert r["node"]["cpu_busy_cores"] == round((150 + 100) / 150, 2)
    assert r["node"]["psi_some"]["memory"] == round((10 + 5) / 150, 4)
    assert r["node"]["oom_kills"] == {"batch": 3} and r["node"]["worker_exits"] == 0
