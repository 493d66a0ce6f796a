"""The torch backend's traced graphs (render/engine/backends/graphs.py): same images as eager, one graph per
prepared size."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from render.engine.backends.graphs import GraphCache  # noqa: E402
from render.engine.backends.select import make_backend  # noqa: E402
from render.engine.model import load_model  # noqa: E402
from turbonode.config import TINY_MODELS  # noqa: E402

SIZE = 64


def _inputs(family, rows: int, size: int = SIZE, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in family.input_shapes(rows, size, size).items()}


@pytest.mark.parametrize("model", TINY_MODELS)
def test_graphs_render_what_eager_renders_at_every_row_count(model):
    family = load_model(model)
    eager = make_backend("torch", family, "cpu", torch_graphs=False)
    graphs = make_backend("torch", family, "cpu")
    assert eager.describe()["execution"] == "eager" and graphs.describe()["execution"] == "graph"
    eager.prepare(SIZE, SIZE)
    graphs.prepare(SIZE, SIZE)  # traced at one row: 3 and 2 rows run through the same graphs
    assert graphs.describe()["graphs"] == 2 and "graphs" not in eager.describe()
    for rows in (3, 2):
        inputs = _inputs(family, rows, seed=rows)
        torch.testing.assert_close(graphs.predict(inputs), eager.predict(inputs), atol=1e-5, rtol=1e-4)
        latents = torch.randn(rows, *family.noise_shape(SIZE, SIZE)[1:], generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(graphs.decode(latents), eager.decode(latents), atol=1e-5, rtol=1e-4)
    other = _inputs(family, 1, size=2 * SIZE)  # a size nobody prepared runs eagerly, traced by nobody
    torch.testing.assert_close(graphs.predict(other), eager.predict(other), atol=1e-5, rtol=1e-4)
    assert graphs.describe()["graphs"] == 2


class _Doubler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python: counts eager calls and the trace, not a graph's runs
        return x * 2


class _DictOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"x": x + 1}  # the tracer refuses a dict output (strict)


def test_a_prepared_signature_runs_its_graph_any_other_the_module():
    module = _Doubler()
    cache = GraphCache(module, [True], "doubler")
    assert cache.prepare(torch.zeros(1, 3)) and module.calls == 1  # the trace ran the module's Python once
    assert cache.prepare(torch.zeros(4, 3)) and len(cache) == 1  # the batch axis is not in the signature
    assert torch.equal(cache(torch.ones(5, 3)), torch.full((5, 3), 2.0)) and module.calls == 1
    assert torch.equal(cache(torch.ones(5, 4)), torch.full((5, 4), 2.0)) and module.calls == 2  # eager


def test_an_untraceable_module_runs_eagerly_and_says_so(caplog):
    cache = GraphCache(_DictOut(), [True], "dict-out")
    with caplog.at_level(logging.WARNING, logger="render.engine.backends.graphs"):
        assert not cache.prepare(torch.zeros(1, 2))
    assert torch.equal(cache(torch.zeros(3, 2))["x"], torch.ones(3, 2)) and len(cache) == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "dict-out: cannot trace for Bx2, running it eagerly" in warnings[0]


def test_a_shared_input_is_part_of_the_signature():
    cache = GraphCache(_Doubler(), [False], "shared")
    cache.prepare(torch.ones(4, 3))
    cache.prepare(torch.ones(5, 3))
    assert len(cache) == 2
    with pytest.raises(ValueError, match="shared takes 1 inputs, got 2"):
        cache(torch.ones(1), torch.ones(1))


HOG_SWITCH_S = 0.02


@contextlib.contextmanager
def gil_hog():
    """A pure-Python thread that gives the GIL up only when the interpreter makes it, every 20 ms."""
    interval, stop = sys.getswitchinterval(), threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    sys.setswitchinterval(HOG_SWITCH_S)
    hog = threading.Thread(target=spin, daemon=True)
    hog.start()
    try:
        yield
    finally:
        stop.set()
        hog.join()
        sys.setswitchinterval(interval)


def test_a_graph_call_takes_the_gil_back_once_not_at_every_op():
    # Eagerly, every op gives the GIL up and waits up to a switch interval to get it back:
    # hundreds of ops, seconds per step next to the hog (measured: ~460-490 intervals per call
    # of this graph's ops run eagerly). A graph gives it up a few times per call (3-20 measured).
    family = load_model("tiny")
    backend = make_backend("torch", family, "cpu")
    backend.prepare(SIZE, SIZE)  # traced (and profiled) before the hog starts: tracing runs the Python
    inputs = _inputs(family, 2)
    with torch.inference_mode():
        graph = torch.jit.trace(backend.denoiser, tuple(inputs[n] for n in family.input_names), check_trace=False)
    ops = sum(1 for _ in graph.inlined_graph.nodes())
    assert ops > 300, ops
    alone = _time_calls(backend, inputs, 3)  # the calls' own compute is not waiting
    with gil_hog():
        waits = (_time_calls(backend, inputs, 3) - alone) / HOG_SWITCH_S
    # A tenth of an interval per op at most: eager waits about one per op.
    assert waits < 3 * ops / 10, f"3 graph calls waited ~{waits:.0f} switch intervals (a graph has {ops} ops)"


def _time_calls(backend, inputs, n: int) -> float:
    started = time.monotonic()
    for _ in range(n):
        backend.predict(inputs)
    return time.monotonic() - started
