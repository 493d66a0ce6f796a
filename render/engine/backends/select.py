"""Choosing a backend: the one place that maps `--backend` to an implementation.

`tensorrt` insists (a clear error where it cannot run); `auto` prefers TensorRT on a CUDA
GPU with the tensorrt package and otherwise falls back to torch, logging why.
"""

from __future__ import annotations

import logging

import torch

from render.engine.families.base import Family
from turbonode.config import BACKEND_NAMES
from turbonode.errors import BackendUnavailable

from .base import Backend

__all__ = ["BackendUnavailable", "make_backend", "resolve_device"]

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when torch sees a GPU, else cpu; anything else is taken as a torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise BackendUnavailable(f"bad device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(f"device {device!r} requested but torch sees no CUDA GPU")
    return dev


def _tensorrt(family: Family, dev: torch.device, options) -> Backend:
    from .tensorrt import TensorRTBackend, TensorRTOptions

    if options is None:
        from turbonode.config import WorkerConfig

        options = TensorRTOptions.from_config(WorkerConfig(), family.native_size)
    try:
        return TensorRTBackend(family, dev, options)
    except BackendUnavailable:
        raise
    except Exception as exc:  # export, build or CUDA failures: a clear message, and auto's fallback
        raise BackendUnavailable(f"tensorrt backend failed to start: {type(exc).__name__}: {exc}") from exc


def make_backend(
    name: str, family: Family, device: str = "auto", *, tensorrt_options=None, torch_graphs: bool = True
) -> Backend:
    """Build the backend `name` ('auto', 'torch', 'tensorrt') for the model `family` on `device`.

    `tensorrt_options` (a render.engine.backends.tensorrt.TensorRTOptions) sets the engines'
    batch range, sizes and cache; None takes the config defaults. `torch_graphs`: the torch
    backend traces its modules (render/engine/backends/graphs.py) rather than running them eagerly.
    """
    if name not in BACKEND_NAMES:
        raise BackendUnavailable(f"unknown backend {name!r} (expected {', '.join(BACKEND_NAMES)})")
    dev = resolve_device(device)
    if name == "tensorrt":
        return _tensorrt(family, dev, tensorrt_options)
    if name == "auto":
        try:
            return _tensorrt(family, dev, tensorrt_options)
        except BackendUnavailable as exc:
            log.warning("backend auto: using torch on %s (%s)", dev, exc)
    from .torch_backend import TorchBackend

    return TorchBackend(family, dev, graphs=torch_graphs)
