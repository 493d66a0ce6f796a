"""The TensorRT backend: a model family's denoiser and VAE decoder as TensorRT engines on one CUDA GPU.

Engines are built from ONNX exports (onnx_export.py: the SD/SDXL UNet with its added inputs,
the SD3/Flux transformers) with one optimisation profile that spans 1..max_batch rows and
the configured resolutions (`Family.input_shapes` at the smallest and largest), and are cached on disk
(engine_cache.py). Inference runs on torch CUDA tensors in place: the engine reads and
writes torch's own device memory (`set_tensor_address(tensor.data_ptr())`) and runs on
torch's current stream, so there is no host copy and no extra synchronisation.

`tensorrt` is imported lazily: this module imports on any machine, and the profile and key
logic (pure functions below) is tested without a GPU.
"""

from __future__ import annotations

import importlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from render.engine.families.base import LATENT_INPUT, PREDICTION, VAE_INPUT, VAE_OUTPUT, Family
from turbonode.errors import BackendUnavailable

from . import onnx_export
from .base import Backend
from .engine_cache import EngineCache, EngineKey
from .sizes import SizeRange

log = logging.getLogger(__name__)

MIN_TRT_MAJOR = 10  # name-based tensor API, execute_async_v3, strongly typed networks
Shape = tuple[int, ...]


@dataclass(frozen=True)
class TensorRTOptions:
    cache_dir: Path
    max_batch: int = 4
    sizes: tuple[tuple[int, int], ...] = ((512, 512),)  # image (height, width) in pixels; first = opt
    precision: str | None = None  # None: the family's half precision (fp16, or bf16 for SD3/Flux)
    optimization_level: int = 3  # TensorRT's default; lower builds faster, runs a little slower

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not self.sizes:
            raise ValueError("at least one image size is needed")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}")

    @classmethod
    def from_config(cls, worker, native_size: int = 512) -> TensorRTOptions:
        """From the [worker] config section: its batch limit, default size (0: the model's) and cache directory."""
        size = worker.size or native_size
        return cls(cache_dir=Path(worker.engine_cache_dir), max_batch=worker.max_batch, sizes=((size, size),))


PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PRECISION_NAMES = {dtype: name for name, dtype in PRECISIONS.items()}


def tensorrt_unavailable_reason() -> str | None:
    """Why the TensorRT backend cannot run in this process, or None when it can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    try:
        trt = importlib.import_module("tensorrt")
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but its CUDA libraries are not
        return (
            f"the tensorrt package is not importable ({exc}); install turbonode[tensorrt] "
            "(CUDA 12 torch) or turbonode[tensorrt-cu13] (CUDA 13 torch)"
        )
    major = int(str(getattr(trt, "__version__", "0")).split(".")[0] or 0)
    if major < MIN_TRT_MAJOR:
        return f"tensorrt {trt.__version__} is too old (need {MIN_TRT_MAJOR}.x or newer)"
    return None


def size_profile(options: TensorRTOptions, multiple: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(min, opt, max) image (height, width) in pixels covering every configured size; opt is the first."""
    for h, w in options.sizes:
        if h % multiple or w % multiple:
            raise ValueError(f"image size {h}x{w} is not a multiple of {multiple} (the model's size step)")
    hs, ws = [h for h, _ in options.sizes], [w for _, w in options.sizes]
    return (min(hs), min(ws)), options.sizes[0], (max(hs), max(ws))


def denoiser_profile(options: TensorRTOptions, family: Family) -> dict[str, tuple[Shape, Shape, Shape]]:
    """min/opt/max shape of each denoiser input. Opt is the full batch: speed matters under load."""
    lo, opt, hi = size_profile(options, family.size_multiple)
    b = options.max_batch
    small, typical, large = family.input_shapes(1, *lo), family.input_shapes(b, *opt), family.input_shapes(b, *hi)
    return {name: (small[name], typical[name], large[name]) for name in family.input_names}


def decoder_profile(options: TensorRTOptions, family: Family) -> dict[str, tuple[Shape, Shape, Shape]]:
    lo, opt, hi = size_profile(options, family.size_multiple)
    b, c = options.max_batch, family.latent_channels
    lat = [family.latent_size(*hw) for hw in (lo, opt, hi)]
    return {VAE_INPUT: ((1, c, *lat[0]), (b, c, *lat[1]), (b, c, *lat[2]))}


def _logger(trt):
    """A TensorRT logger that forwards to Python logging (TensorRT's own prints to stdout)."""
    sev = trt.ILogger.Severity
    levels = {
        sev.INTERNAL_ERROR: logging.CRITICAL,
        sev.ERROR: logging.ERROR,
        sev.WARNING: logging.WARNING,
        sev.INFO: logging.DEBUG,
        sev.VERBOSE: logging.DEBUG,
    }

    class _Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            log.log(levels.get(severity, logging.INFO), "tensorrt: %s", msg)

    return _Log()


def _progress_monitor(trt):
    """Logs each top-level build phase: its start, every quarter of its steps, its duration."""

    class _Progress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.top: dict[str, tuple[int, float]] = {}  # top-level phase -> (steps, start time)

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:  # nested phases (per-layer tactic timing) would flood the log
                self.top[phase_name] = (num_steps, time.monotonic())
                log.info("tensorrt build: %s (%d steps)", phase_name, num_steps)

        def step_complete(self, phase_name, step):
            total = self.top.get(phase_name, (0, 0.0))[0]
            if total >= 4 and (step + 1) % (total // 4) == 0:
                log.info("tensorrt build: %s %d/%d", phase_name, step + 1, total)
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            if phase_name in self.top:
                log.info(
                    "tensorrt build: %s done in %.1f s", phase_name, time.monotonic() - self.top.pop(phase_name)[1]
                )

    return _Progress()


def build_serialized_engine(
    trt, onnx_path: Path, profile: dict[str, tuple[Shape, Shape, Shape]], options: TensorRTOptions, logger
) -> bytes:
    """Parse the ONNX file and build one engine with `profile`; the bytes of the plan."""
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        # Precision comes from the exported graph: required on 10.x for that, implied on 11.x.
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendUnavailable(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.builder_optimization_level = options.optimization_level
    monitor = _progress_monitor(trt)  # held here: the config does not keep the Python object alive
    config.progress_monitor = monitor
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    plan = builder.build_serialized_network(network, config)
    return bytes(plan) if plan is not None else b""


class EngineRunner:
    """One deserialized engine and its execution context, run on torch CUDA tensors."""

    def __init__(self, trt, engine, device: torch.device):
        self.engine = engine
        self.context = engine.create_execution_context()
        self.device = device
        dtypes = {
            trt.float32: torch.float32,
            trt.float16: torch.float16,
            trt.int32: torch.int32,
            trt.int64: torch.int64,
            trt.bfloat16: torch.bfloat16,
        }
        self.inputs: dict[str, torch.dtype] = {}
        self.outputs: dict[str, torch.dtype] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            side = self.inputs if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else self.outputs
            side[name] = dtypes[engine.get_tensor_dtype(name)]

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        for name, tensor in feeds.items():
            # Inputs must be contiguous device tensors of the engine's dtype; the caller
            # keeps them alive, and torch's allocator never reuses their memory before the
            # work queued on this stream has run.
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise BackendUnavailable(f"input {name} of shape {tuple(tensor.shape)} is outside the engine's profile")
            self.context.set_tensor_address(name, tensor.data_ptr())
        out = {}
        with torch.cuda.device(self.device):  # TensorRT runs on the calling thread's current device
            for name, dtype in self.outputs.items():
                out[name] = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=dtype, device=self.device)
                self.context.set_tensor_address(name, out[name].data_ptr())
            if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
                raise BackendUnavailable("TensorRT failed to enqueue the engine (see the log)")
        return out


class EngineFactory:
    """Cached TensorRT engines for a model family, on one CUDA device with one set of options."""

    def __init__(self, device: torch.device, options: TensorRTOptions):
        reason = tensorrt_unavailable_reason()
        if reason:
            raise BackendUnavailable(f"tensorrt backend unavailable: {reason}")
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable(f"tensorrt backend unavailable: device {device} is not a CUDA GPU")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
        self.trt = importlib.import_module("tensorrt")
        self.options = options
        self.logger = _logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self.cache = EngineCache(options.cache_dir)

    def key(self, component: str, family: Family, precision: str) -> EngineKey:
        props = torch.cuda.get_device_properties(self.device)
        return EngineKey(
            component=component,
            family=family.name,
            model_hash=family.fingerprint,
            trt_version=self.trt.__version__,
            gpu_name=props.name,
            compute_capability=(props.major, props.minor),
            min_batch=1,
            max_batch=self.options.max_batch,
            resolutions=self.options.sizes,
            precision=precision,
        )

    def denoiser(self, family: Family, precision: str) -> EngineRunner:
        def export(path: Path) -> None:
            onnx_export.export_denoiser(family, path, device=self.device, dtype=PRECISIONS[precision])

        return self._get(self.key("denoiser", family, precision), export, denoiser_profile(self.options, family))

    def decoder(self, family: Family, precision: str) -> EngineRunner:
        def export(path: Path) -> None:
            onnx_export.export_decoder(family, path, device=self.device, dtype=PRECISIONS[precision])

        return self._get(self.key("decoder", family, precision), export, decoder_profile(self.options, family))

    def _get(self, key: EngineKey, export: Callable[[Path], None], profile: dict) -> EngineRunner:
        def build() -> bytes:
            # GBs for SDXL, tens of GB for Flux (graph + external data): exported into a scratch
            # directory that goes when the engine is built; a rebuild exports afresh.
            scratch = Path(tempfile.mkdtemp(prefix=".onnx-", dir=self.cache.root))
            try:
                onnx_path = scratch / f"{key.family}-{key.component}.onnx"
                export(onnx_path)
                torch.cuda.empty_cache()
                return build_serialized_engine(self.trt, onnx_path, profile, self.options, self.logger)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

        def deserialize(blob: bytes):
            engine = self.runtime.deserialize_cuda_engine(blob)
            return None if engine is None else EngineRunner(self.trt, engine, self.device)

        self.cache.root.mkdir(parents=True, exist_ok=True)
        with torch.cuda.device(self.device):
            return self.cache.load_or_build(key, build, deserialize)


class TensorRTBackend(Backend):
    """The family's denoiser and VAE decoder as cached TensorRT engines; the text encoders stay in torch."""

    name = "tensorrt"

    def __init__(self, family: Family, device: torch.device, options: TensorRTOptions):
        self.engines = EngineFactory(device, options)
        self.options, self.family = options, family
        precision = options.precision or PRECISION_NAMES[family.cuda_dtype]
        self.device, self.dtype = self.engines.device, PRECISIONS[precision]
        self.shared_inputs = frozenset(family.shared_axes)  # per token, not per row: never split by row
        self.denoiser = self.engines.denoiser(family, precision)
        # SDXL's VAE overflows in fp16 (its config says force_upcast): its engine is built in fp32
        self.decoder = self.engines.decoder(family, "fp32" if family.vae_needs_fp32(self.dtype) else precision)
        self.scale = family.vae_scale_factor

    def prepare(self, height: int, width: int) -> None:
        """Nothing left: every profile's engine was built (or loaded) at start."""

    def sizes(self) -> SizeRange:
        low, _, high = size_profile(self.options, self.family.size_multiple)
        return SizeRange(low, high, "this node's TensorRT engines")

    def _chunks(self, n: int):
        step = self.options.max_batch
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    @torch.inference_mode()
    def predict(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # an input's dtype is the engine's (timesteps, ids, guidance: float32; the rest the precision)
        feeds = {n: t.to(self.device, self.denoiser.inputs[n]).contiguous() for n, t in inputs.items()}
        rows = feeds[LATENT_INPUT].shape[0]
        outs = [
            self.denoiser(**{n: t if n in self.shared_inputs else t[s] for n, t in feeds.items()})[PREDICTION]
            for s in self._chunks(rows)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        reason = self.unsupported_size(latents.shape[-2] * self.scale, latents.shape[-1] * self.scale)
        if reason:
            raise BackendUnavailable(reason)
        x = latents.to(self.device, self.decoder.inputs[VAE_INPUT]).contiguous()
        outs = [self.decoder(**{VAE_INPUT: x[s]})[VAE_OUTPUT] for s in self._chunks(x.shape[0])]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "tensorrt": self.engines.trt.__version__,
            "max_batch": self.options.max_batch,
            "sizes": [f"{h}x{w}" for h, w in self.options.sizes],
        }
