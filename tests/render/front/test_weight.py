"""The worker's weight for HAProxy's agent-check (render/weight.py, render/front/weight_agent.py): the
policy on a fake clock, the agent's reply on a real socket, and the configuration of its port."""

from __future__ import annotations

import asyncio
import random

import pytest

from render.front.weight_agent import WeightAgent
from render.weight import (
    FLOOR_PCT,
    FULL_PCT,
    HEALTHY_SLOWDOWN,
    LEARN_STEPS,
    RELEARN_S,
    STALE_S,
    StepPace,
    weight_percent,
)
from turbonode.config import WEIGHT_PORT_OFFSET, load_config, node_workers, weight_address

SMALL, BIG = ((64, 64), 1), ((64, 64), 4)  # step keys: image shape, batch rows
STEP_S = 0.1


class Steps:
    """A StepPace fed steps on a fake clock."""

    def __init__(self) -> None:
        self.pace, self.now = StepPace(), 1000.0

    def run(self, n: int, seconds: float, key=SMALL) -> None:
        for _ in range(n):
            self.now += seconds
            self.pace.observe(key, seconds, self.now)

    def weight(self) -> int:
        return weight_percent(self.pace.slowdown(self.now))


def learnt(seconds: float = STEP_S, key=SMALL, steps: Steps | None = None) -> Steps:
    """A key's first step (not counted), its LEARN_STEPS, and a few more."""
    s = steps or Steps()
    s.run(1 + LEARN_STEPS + 20, seconds, key)
    return s


def test_weight_percent_full_floor_and_steep_between():
    assert weight_percent(None) == FULL_PCT
    assert weight_percent(1.0) == weight_percent(HEALTHY_SLOWDOWN) == FULL_PCT
    assert 20 <= weight_percent(1.4) <= 40 and weight_percent(1.5) <= 10
    assert weight_percent(1.7) == weight_percent(100.0) == FLOOR_PCT > 0
    values = [weight_percent(HEALTHY_SLOWDOWN + i / 20) for i in range(30)]
    assert values == sorted(values, reverse=True)


def test_unknown_until_the_usual_pace_is_learnt_and_the_first_step_not_counted():
    s = Steps()
    s.run(1, 2.0)  # the first step traces a graph: slow, and no reason for a low weight
    s.run(LEARN_STEPS - 1, STEP_S)
    assert s.pace.slowdown(s.now) is None and s.weight() == FULL_PCT
    s.run(2, STEP_S)
    assert s.pace.slowdown(s.now) == pytest.approx(1.0) and s.weight() == FULL_PCT


def test_a_slow_node_drops_within_a_second_and_recovers():
    s = learnt()
    s.run(2, 3 * STEP_S)  # a CPU hog: steps three times as long
    assert s.weight() < 50  # 0.6 s into it
    s.run(2, 3 * STEP_S)
    assert s.weight() == FLOOR_PCT  # 1.2 s into it
    s.run(20, STEP_S)  # the fault is over: two seconds later still seen (FALL_S) ...
    assert s.weight() < FULL_PCT
    s.run(100, STEP_S)  # ... twelve seconds later gone
    assert s.weight() == FULL_PCT


def test_a_pause_in_a_storm_does_not_let_turbo_in():
    s = learnt()
    for _ in range(10):  # a fault's bursts with a second at the usual pace between them
        s.run(4, 3 * STEP_S)
        assert s.weight() == FLOOR_PCT
        s.run(10, STEP_S)
        assert s.weight() <= 10


def test_a_lasting_slowdown_stays_visible_then_becomes_the_usual_pace():
    s = learnt()
    s.run(int(60 / (3 * STEP_S)), 3 * STEP_S)  # a fault window of a minute
    assert s.weight() == FLOOR_PCT  # the usual pace rose by a tenth of the difference
    s.run(int(3 * RELEARN_S / (3 * STEP_S)), 3 * STEP_S)  # three times RELEARN_S: the new normal
    assert s.weight() == FULL_PCT


def test_per_key_usual_times_a_bigger_batch_is_not_slow():
    s = learnt()
    learnt(3 * STEP_S, BIG, s)  # a batch of 4 rows costs 3x, always has
    s.run(5, STEP_S)
    assert s.weight() == FULL_PCT
    s.run(4, 6 * STEP_S, key=BIG)  # now it is slow
    assert s.weight() <= 10


def test_noise_below_the_healthy_bound_keeps_full_weight():
    s = learnt()
    for i in range(300):  # alternating +-30 % per step
        s.run(1, STEP_S * (1.3 if i % 2 else 0.7))
        assert s.weight() == FULL_PCT
    # steps as a node of 0.5 CPU runs them (128-256 px): +-20 % from one to the next
    rng = random.Random(23)
    quota, weights = Steps(), []
    for _ in range(1 + LEARN_STEPS + 5000):
        quota.run(1, max(0.01, rng.gauss(0.07, 0.014)))
        weights.append(quota.weight())
    assert sum(w == FULL_PCT for w in weights) / len(weights) > 0.99


def test_stale_after_an_idle_spell_then_judged_afresh():
    s = learnt()
    s.run(8, 3 * STEP_S)
    assert s.weight() == FLOOR_PCT
    s.now += STALE_S + 1  # idle: nothing to judge by
    assert s.pace.slowdown(s.now) is None and s.weight() == FULL_PCT
    s.run(1, STEP_S)  # the first step after it: as fast as usual, not averaged with the storm
    assert s.weight() == FULL_PCT


def test_a_usual_pace_learnt_while_slow_comes_down():
    s = learnt(2 * STEP_S)  # the worker started during a fault
    s.run(300, STEP_S)
    assert s.pace.slowdown(s.now) == pytest.approx(1.0, abs=0.1)
    s.run(6, 2 * STEP_S)
    assert s.weight() <= 10


def test_agent_answers_one_line_and_closes():
    async def main() -> tuple[bytes, bytes]:
        answers = iter([37, FLOOR_PCT])
        agent = WeightAgent(lambda: next(answers))
        host, port = await agent.start("127.0.0.1", 0)
        out = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection(host, port)
            out.append(await asyncio.wait_for(reader.read(), 5))  # until the agent closes
            writer.close()
        await agent.close()
        return out[0], out[1]

    assert asyncio.run(main()) == (b"37%\n", f"{FLOOR_PCT}%\n".encode())


def test_agent_answers_full_when_the_engine_cannot_say():
    def broken() -> int:
        raise ConnectionError("the engine process has exited")

    async def main() -> bytes:
        agent = WeightAgent(broken)
        host, port = await agent.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(host, port)
        line = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await agent.close()
        return line

    assert asyncio.run(main()) == b"100%\n"


# ---- configuration ------------------------------------------------------------------------


def test_weight_port_default_derived_from_each_http_port(tmp_path):
    cfg = load_config(None, env={})
    assert weight_address(cfg.worker.listen, cfg.worker.weight_port) == ("0.0.0.0", 8460 + WEIGHT_PORT_OFFSET)
    assert weight_address("127.0.0.1:0", 0) == ("127.0.0.1", 0)  # an ephemeral HTTP port: an ephemeral one
    assert weight_address("127.0.0.1:8460", -1) is None
    path = tmp_path / "c.toml"
    path.write_text("[workers.a]\n[workers.b]\n[workers.c]\nweight_port = 9000\n")
    specs = node_workers(load_config(str(path), env={}))
    assert [weight_address(s.listen, s.weight_port)[1] for s in specs] == [8560, 8561, 9000]
    path.write_text("[worker]\nweight_port = 9100\n[workers.a]\n[workers.b]\n")
    specs = node_workers(load_config(str(path), env={}))
    assert [weight_address(s.listen, s.weight_port)[1] for s in specs] == [9100, 9101]
