"""Choosing a backend: the one place that maps `--backend` to an implementation."""

from __future__ import annotations

import torch

from turbonode.errors import TurbonodeError

from .base import Backend


class BackendUnavailable(TurbonodeError):
    """The requested backend cannot run here (or is not built in)."""


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


def make_backend(name: str, components, device: str = "auto") -> Backend:
    """Build the backend `name` ('auto', 'torch', 'tensorrt') for `components` on `device`."""
    dev = resolve_device(device)
    if name in ("auto", "torch"):
        from .torch_backend import TorchBackend

        return TorchBackend(components, dev)
    if name == "tensorrt":
        raise BackendUnavailable("the tensorrt backend is not built into this worker yet; use --backend torch")
    raise BackendUnavailable(f"unknown backend {name!r} (expected auto, torch or tensorrt)")
