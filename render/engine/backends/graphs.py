"""Traced graphs: a torch module run as TorchScript for the input signatures prepared at start.

Why: an eager forward is hundreds of op calls, and each releases the GIL and takes it back.
When another thread of the worker holds the GIL (a full GC pass over a large heap holds it for
tens of milliseconds, a busy request handler for its switch interval), every take waits: a
tiny-UNet step of 35 ms took 444 ms (p99) next to a thread making cyclic garbage. A traced graph
runs all its ops in C++ and gives the GIL up once per call: the same step took 58 ms
(bench/graph_gil.py, docs/benchmarks.md).

A trace records one path through the module's Python: branches on sizes are frozen into it.
So each signature (every input's shape and dtype) gets its own graph, except along the batch
axis, which the traced ops carry symbolically (tests/render/engine/test_torch_graphs.py checks each model
family's graphs against eager at other row counts). Graphs are traced when the backend is
prepared, never inside a request: a trace runs the module's Python once more (0.4 s for the
tiny UNet, far more for a real one) and would stall every queued step, so a signature nobody
prepared (an image size other than the default) runs eagerly. A module that cannot be traced
runs eagerly too, said in the log.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

# The profiling executor optimises a graph on its second run: those runs happen when the graph
# is prepared, not inside a request.
PROFILING_RUNS = 2

Signature = tuple[tuple[tuple[int | None, ...], torch.dtype], ...]


class GraphCache:
    """Call `module(*args)` through the graph traced for the args' signature, eagerly when there is none.

    `batched[i]` says whether argument i's first axis is the batch (rows); other axes, and
    arguments shared by every row, are part of the signature.
    """

    def __init__(self, module: torch.nn.Module, batched: Sequence[bool], name: str):
        self.module = module
        self.batched = tuple(batched)
        self.name = name
        self._graphs: dict[Signature, Callable[..., torch.Tensor]] = {}

    def __len__(self) -> int:
        """Signatures that run as a graph."""
        return len(self._graphs)

    def signature(self, args: Sequence[torch.Tensor]) -> Signature:
        if len(args) != len(self.batched):
            raise ValueError(f"{self.name} takes {len(self.batched)} inputs, got {len(args)}")
        return tuple(
            ((None, *a.shape[1:]) if batch else tuple(a.shape), a.dtype) for a, batch in zip(args, self.batched)
        )

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self._graphs.get(self.signature(args), self.module)(*args)

    def prepare(self, *args: torch.Tensor) -> bool:
        """Trace a graph for the signature of `args` (examples: their values do not matter); False if it cannot be."""
        key = self.signature(args)
        if key in self._graphs:
            return True
        started = time.monotonic()
        try:
            with warnings.catch_warnings():
                # the tracer warns at every Python branch on a size: the signature covers those
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                graph = torch.jit.trace(self.module, tuple(args), check_trace=False)
            for _ in range(PROFILING_RUNS):
                graph(*args)
        except Exception as exc:  # an untraceable module still renders, eagerly
            log.warning(
                "%s: cannot trace for %s, running it eagerly: %s: %s", self.name, _shapes(key), type(exc).__name__, exc
            )
            return False
        log.info("%s: traced for %s in %.2f s", self.name, _shapes(key), time.monotonic() - started)
        self._graphs[key] = graph
        return True


def _shapes(key: Signature) -> str:
    return ", ".join("x".join("B" if d is None else str(d) for d in shape) for shape, _ in key)
