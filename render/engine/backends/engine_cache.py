"""On-disk cache of built TensorRT engines.

An engine is only valid for the exact model weights, TensorRT version, GPU model (compute
capability) and the optimisation profile and precision it was built with, so all of those
are the key. Building an SD-sized engine takes minutes; loading one takes a second.

The key logic is pure (no TensorRT, no GPU) so it is tested everywhere. The cache writes
atomically (temp file + rename in the same directory): a worker killed mid-write leaves no
half engine behind, and two workers building the same key at once both end with a whole
file. An entry that fails to deserialize (truncated, other TensorRT build, bit rot) is
deleted and rebuilt, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from turbonode import sdnotify
from turbonode.errors import BackendUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
KEY_VERSION = 2  # bump when what an engine depends on changes in a way the fields do not show


@dataclass(frozen=True)
class EngineKey:
    """Everything a serialized engine depends on."""

    component: str  # "denoiser" or "decoder"
    family: str  # the model family (render/engine/families): its graph's inputs differ from another's
    model_hash: str  # content hash of the weights and config
    trt_version: str
    gpu_name: str
    compute_capability: tuple[int, int]
    min_batch: int
    max_batch: int
    resolutions: tuple[tuple[int, int], ...]  # image (height, width) pairs the profile covers
    precision: str  # "fp16" / "fp32": the dtype the graph was exported in

    def __post_init__(self):
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(f"batch range {self.min_batch}..{self.max_batch} is empty")
        if not self.resolutions:
            raise ValueError("an engine needs at least one resolution")
        # Order and duplicates of the configured resolutions do not change the engine.
        object.__setattr__(self, "resolutions", tuple(sorted({tuple(r) for r in self.resolutions})))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))

    def canonical(self) -> str:
        return json.dumps({"v": KEY_VERSION, **asdict(self)}, sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def filename(self) -> str:
        return f"{self.family}-{self.component}-{self.precision}-{self.digest()[:20]}.engine"

    @property
    def what(self) -> str:
        """How the logs name it: 'the sdxl denoiser'."""
        return f"{self.family} {self.component}"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class EngineCache:
    """Engines under one directory, one file per key plus a readable JSON of the key."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path_for(self, key: EngineKey) -> Path:
        return self.root / key.filename()

    def load_or_build(self, key: EngineKey, build: Callable[[], bytes], deserialize: Callable[[bytes], T]) -> T:
        """The engine for `key`: from disk when a good copy is there, else built and stored.

        `deserialize` returns None or raises for bytes it cannot use (TensorRT returns None).
        """
        path = self.path_for(key)
        if path.exists():
            engine = self._try_deserialize(path, path.read_bytes(), deserialize)
            if engine is not None:
                log.info("engine cache hit: %s", path)
                return engine
            log.warning("cached engine %s does not deserialize: rebuilding it", path)
            path.unlink(missing_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        # The worker serves nothing for the minutes a large engine takes: say why, in the log
        # (the worker shows its lifecycle at INFO) and in `systemctl status`.
        log.info(
            "building the %s engine (%s, batch %d..%d, %s): minutes for a large model -> %s",
            key.what,
            key.precision,
            key.min_batch,
            key.max_batch,
            ", ".join(f"{h}x{w}" for h, w in key.resolutions),
            path,
        )
        sdnotify.notify(f"STATUS=building the {key.what} TensorRT engine (ONNX export, then TensorRT)")
        started = time.monotonic()
        blob = build()
        if not blob:
            raise BackendUnavailable(f"TensorRT could not build the {key.what} engine (see the log above)")
        log.info("built the %s engine in %.1f s (%.1f MiB)", key.what, time.monotonic() - started, len(blob) / 2**20)
        engine = self._try_deserialize(path, blob, deserialize)
        if engine is None:
            raise BackendUnavailable(f"the freshly built {key.what} engine does not deserialize")
        _atomic_write(path, bytes(blob))
        _atomic_write(path.with_suffix(".json"), key.canonical().encode() + b"\n")
        return engine

    @staticmethod
    def _try_deserialize(path: Path, blob: bytes, deserialize: Callable[[bytes], T]) -> T | None:
        try:
            return deserialize(blob)
        except Exception as exc:  # any failure means "unusable copy", handled by rebuilding
            log.warning("deserializing %s failed: %s", path.name, exc)
            return None
