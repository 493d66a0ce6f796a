"""The TensorRT backend: UNet and VAE decoder as TensorRT engines on one CUDA GPU.

Engines are built from ONNX exports (onnx_export.py) with one optimisation profile that
spans batch 1..max_batch and the configured resolutions, and are cached on disk
(engine_cache.py). Inference runs on torch CUDA tensors in place: the engine reads and
writes torch's own device memory (`set_tensor_address(tensor.data_ptr())`) and runs on
torch's current stream, so there is no host copy and no extra synchronisation.

`tensorrt` is imported lazily: this module imports on any machine, and the profile and key
logic (pure functions below) is tested without a GPU.
"""

from __future__ import annotations

import copy
import importlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from turbonode.errors import BackendUnavailable

from . import onnx_export
from .base import Backend
from .engine_cache import EngineCache, EngineKey

log = logging.getLogger(__name__)

MIN_TRT_MAJOR = 10  # name-based tensor API, execute_async_v3, strongly typed networks
Shape = tuple[int, ...]


@dataclass(frozen=True)
class TensorRTOptions:
    cache_dir: Path
    max_batch: int = 4
    sizes: tuple[tuple[int, int], ...] = ((512, 512),)  # image (height, width) in pixels; first = opt
    precision: str = "fp16"
    optimization_level: int = 3  # TensorRT's default; lower builds faster, runs a little slower

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not self.sizes:
            raise ValueError("at least one image size is needed")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}")

    @classmethod
    def from_config(cls, worker) -> TensorRTOptions:
        """From the [worker] config section: its batch limit, default size and cache directory."""
        return cls(
            cache_dir=Path(worker.engine_cache_dir), max_batch=worker.max_batch, sizes=((worker.size, worker.size),)
        )


PRECISIONS = {"fp16": torch.float16, "fp32": torch.float32}


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


def latent_profile(options: TensorRTOptions, scale: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(min, opt, max) latent (height, width) covering every configured image size."""
    for h, w in options.sizes:
        if h % scale or w % scale:
            raise ValueError(f"image size {h}x{w} is not a multiple of the VAE scale {scale}")
    lat = [(h // scale, w // scale) for h, w in options.sizes]
    return ((min(h for h, _ in lat), min(w for _, w in lat)), lat[0], (max(h for h, _ in lat), max(w for _, w in lat)))


def unet_profile(
    options: TensorRTOptions, *, in_channels: int, text_len: int, embed_dim: int, scale: int
) -> dict[str, tuple[Shape, Shape, Shape]]:
    """min/opt/max shape of each UNet input. Opt is the full batch: speed matters under load."""
    (h0, w0), (h1, w1), (h2, w2) = latent_profile(options, scale)
    b = options.max_batch
    sample, timestep, ehs = onnx_export.UNET_INPUTS
    return {
        sample: ((1, in_channels, h0, w0), (b, in_channels, h1, w1), (b, in_channels, h2, w2)),
        timestep: ((1,), (b,), (b,)),
        ehs: ((1, text_len, embed_dim), (b, text_len, embed_dim), (b, text_len, embed_dim)),
    }


def vae_profile(options: TensorRTOptions, *, latent_channels: int, scale: int) -> dict[str, tuple[Shape, Shape, Shape]]:
    (h0, w0), (h1, w1), (h2, w2) = latent_profile(options, scale)
    b = options.max_batch
    return {
        onnx_export.VAE_INPUT: (
            (1, latent_channels, h0, w0),
            (b, latent_channels, h1, w1),
            (b, latent_channels, h2, w2),
        )
    }


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
    """Cached TensorRT engines for torch modules, on one CUDA device with one set of options."""

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
        self.dtype = PRECISIONS[options.precision]
        self.logger = _logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self.cache = EngineCache(options.cache_dir)

    def key(self, component: str, model_hash: str) -> EngineKey:
        props = torch.cuda.get_device_properties(self.device)
        return EngineKey(
            component=component,
            model_hash=model_hash,
            trt_version=self.trt.__version__,
            gpu_name=props.name,
            compute_capability=(props.major, props.minor),
            min_batch=1,
            max_batch=self.options.max_batch,
            resolutions=self.options.sizes,
            precision=self.options.precision,
        )

    def unet(self, unet, model_hash: str, *, text_len: int, scale: int) -> EngineRunner:
        cfg = unet.config
        profile = unet_profile(
            self.options, in_channels=cfg.in_channels, text_len=text_len, embed_dim=cfg.cross_attention_dim, scale=scale
        )
        return self._get(
            "unet", model_hash, unet, onnx_export.export_unet, profile, onnx_export.ExportShape(text_len=text_len)
        )

    def vae_decoder(self, vae, model_hash: str, *, scale: int) -> EngineRunner:
        profile = vae_profile(self.options, latent_channels=vae.config.latent_channels, scale=scale)
        return self._get(
            "vae_decoder", model_hash, vae, onnx_export.export_vae_decoder, profile, onnx_export.ExportShape()
        )

    def _get(
        self, component: str, model_hash: str, module, export, profile, shape: onnx_export.ExportShape
    ) -> EngineRunner:
        key = self.key(component, model_hash)
        onnx_path = self.cache.root / "onnx" / f"{component}-{model_hash}-{key.precision}.onnx"

        def build() -> bytes:
            # Export from a copy: the caller's torch module keeps its device and dtype.
            shadow = copy.deepcopy(module).to(self.device, self.dtype)
            export(shadow, onnx_path, shape=shape)
            del shadow
            torch.cuda.empty_cache()
            try:
                return build_serialized_engine(self.trt, onnx_path, profile, self.options, self.logger)
            finally:
                onnx_path.unlink(missing_ok=True)  # GBs for SD; a rebuild exports afresh

        def deserialize(blob: bytes):
            engine = self.runtime.deserialize_cuda_engine(blob)
            return None if engine is None else EngineRunner(self.trt, engine, self.device)

        with torch.cuda.device(self.device):
            return self.cache.load_or_build(key, build, deserialize)


class TensorRTBackend(Backend):
    """UNet and VAE decoder as cached TensorRT engines; the text encoder stays in torch."""

    name = "tensorrt"

    def __init__(self, components, device: torch.device, options: TensorRTOptions):
        self.engines = EngineFactory(device, options)
        self.device, self.dtype, self.options = self.engines.device, self.engines.dtype, options
        self.scale = components.vae_scale_factor
        self.unet = self.engines.unet(
            components.unet, components.fingerprint, text_len=components.tokenizer.model_max_length, scale=self.scale
        )
        self.vae = self.engines.vae_decoder(components.vae, components.fingerprint, scale=self.scale)

    def unsupported_size(self, height: int, width: int) -> str | None:
        (h0, w0), _, (h2, w2) = [(h * self.scale, w * self.scale) for h, w in latent_profile(self.options, self.scale)]
        if h0 <= height <= h2 and w0 <= width <= w2:
            return None
        # WIDTHxHEIGHT, as the API's 'size' is written
        return (
            f"{width}x{height} is outside what this node's TensorRT engines were built for "
            f"({w0}x{h0} to {w2}x{h2}; worker.size sets it)"
        )

    def _check_size(self, latents: torch.Tensor) -> None:
        reason = self.unsupported_size(latents.shape[-2] * self.scale, latents.shape[-1] * self.scale)
        if reason:
            raise BackendUnavailable(reason)

    def _chunks(self, n: int):
        step = self.options.max_batch
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    @torch.inference_mode()
    def predict_noise(self, latents, timesteps, encoder_hidden_states):
        self._check_size(latents)
        dev, dtype = self.device, self.unet.inputs["sample"]
        sample = latents.to(dev, dtype).contiguous()
        t = timesteps.to(dev, torch.float32).reshape(-1).expand(sample.shape[0]).contiguous()
        ehs = encoder_hidden_states.to(dev, self.unet.inputs["encoder_hidden_states"]).contiguous()
        outs = [
            self.unet(sample=sample[s], timestep=t[s], encoder_hidden_states=ehs[s])[onnx_export.UNET_OUTPUT]
            for s in self._chunks(sample.shape[0])
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def decode(self, latents):
        self._check_size(latents)
        x = latents.to(self.device, self.vae.inputs[onnx_export.VAE_INPUT]).contiguous()
        outs = [self.vae(**{onnx_export.VAE_INPUT: x[s]})[onnx_export.VAE_OUTPUT] for s in self._chunks(x.shape[0])]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "tensorrt": self.engines.trt.__version__,
            "max_batch": self.options.max_batch,
            "sizes": [f"{h}x{w}" for h, w in self.options.sizes],
        }
