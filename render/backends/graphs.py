"""Traced graphs: a torch module run as TorchScript, one graph per input signature.

Why: an eager forward is hundreds of op calls, and each releases the GIL and takes it back.
When another thread of the worker holds the GIL (a full GC pass over a large heap holds it for
tens of milliseconds, a busy request handler for its switch interval), every take waits: a
tiny-UNet step of 7 ms took 320 ms p50 next to a thread making cyclic garbage. A traced graph
runs all its ops in C++ and gives the GIL up once per call: the same step took 4.7 ms p50
(bench/graph_gil.py, docs/benchmarks.md).

A trace records one path through the module's Python: branches on sizes are frozen into it.
So each signature (every input's shape and dtype) gets its own graph, except along the batch
axis, which the traced ops carry symbolically (tests/test_torch_graphs.py checks each model
family's graphs against eager at other row counts). A module that cannot be traced for a
signature runs eagerly for it, said once in the log.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

# Signatures kept: sizes x dtypes a worker renders; the least recently used graph goes first.
MAX_GRAPHS = 16
# The profiling executor optimises a graph on its second run: those runs happen at trace time,
# not inside a request.
PROFILING_RUNS = 2

Signature = tuple[tuple[tuple[int | None, ...], torch.dtype], ...]


class GraphCache:
    """Call `module(*args)` through a traced graph for the args' signature, tracing on first use.

    `batched[i]` says whether argument i's first axis is the batch (rows); other axes, and
    arguments shared by every row, are part of the signature.
    """

    def __init__(self, module: torch.nn.Module, batched: Sequence[bool], name: str, max_graphs: int = MAX_GRAPHS):
        self.module = module
        self.batched = tuple(batched)
        self.name = name
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[Signature, Callable[..., torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def signature(self, args: Sequence[torch.Tensor]) -> Signature:
        if len(args) != len(self.batched):
            raise ValueError(f"{self.name} takes {len(self.batched)} inputs, got {len(args)}")
        return tuple(
            ((None, *a.shape[1:]) if batch else tuple(a.shape), a.dtype) for a, batch in zip(args, self.batched)
        )

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        key = self.signature(args)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._trace(key, args)
                self._graphs[key] = graph
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(key)
        return graph(*args)

    def _trace(self, key: Signature, args: Sequence[torch.Tensor]) -> Callable[..., torch.Tensor]:
        started = time.monotonic()
        try:
            with warnings.catch_warnings():
                # the tracer warns at every Python branch on a size: the signature key covers those
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                graph = torch.jit.trace(self.module, tuple(args), check_trace=False)
            for _ in range(PROFILING_RUNS):
                graph(*args)
        except Exception as exc:  # an untraceable module still renders, eagerly
            log.warning(
                "%s: cannot trace for %s, running it eagerly: %s: %s", self.name, _shapes(key), type(exc).__name__, exc
            )
            return self.module
        log.info("%s: traced for %s in %.2f s", self.name, _shapes(key), time.monotonic() - started)
        return graph

    def traced(self) -> int:
        """Signatures that run as a graph (not those that fell back to eager)."""
        return sum(g is not self.module for g in self._graphs.values())


def _shapes(key: Signature) -> str:
    return ", ".join("x".join("B" if d is None else str(d) for d in shape) for shape, _ in key)
