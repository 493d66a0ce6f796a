"""Export a model family's denoiser and VAE decoder to ONNX, the input of the TensorRT engine builder.

The denoiser graph takes exactly what the family's `denoiser_inputs` builds, under the same
names (`Family.input_names`, render/engine/families/base.py): latents, one timestep per row, every
row's conditioning (SDXL text_embeds and time_ids, SD3/Flux pooled projections, Flux-dev
guidance) and Flux's position ids; the decoder graph takes latents as the scheduler left
them (un-scaling and un-shifting inside). Batch, latent size and text length are dynamic
axes (`Family.dynamic_axes`), so one file serves every optimisation profile.

Exporter choice: the TorchScript tracer (`dynamo=False`), not torch 2.13's default dynamo
exporter. The dynamo exporter needs onnxscript, which the lean install does not have (and
the checked environment lacks), and `torch.export` with explicit symbolic-dimension ranges,
against which diffusers' Python-side shape branches (e.g. the up-sampling size check) are a
risk. The tracer records the shape arithmetic as Shape ops that the TensorRT ONNX parser
resolves per profile; it is the exporter NVIDIA's Stable Diffusion demos have used. Two
things the transformer families need from it are added for the duration of an export
(`_traceable`): a symbolic for `aten::rms_norm` and a rotary embedding that keeps its shapes
symbolic. Tested here: batch, size and text length stay dynamic and the graphs match torch
to ~1e-6 (fp32) on onnxruntime.

Precision lives in the graph: TensorRT 11 builds strongly typed networks only (no FP16
builder flag), so an fp16 engine is built from a graph exported in fp16. Graphs over 2 GB
(an SDXL UNet in fp16 is ~5 GB, Flux's transformer ~24 GB) cannot be one protobuf: their
weights go to ONE external data file next to the graph, `<name>.onnx.data`, which the
TensorRT parser and onnxruntime read from the same directory.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from render.engine.families.base import FLOAT32_INPUTS, PREDICTION, TIMESTEP_INPUT, VAE_INPUT, VAE_OUTPUT, Family

log = logging.getLogger(__name__)

OPSET = 17  # first opset with LayerNormalization; TensorRT 10/11 parse up to 20+
EXTERNAL_DATA_THRESHOLD = 2**30  # bytes of weights above which they go to external data (protobuf: 2 GiB)


def _export(
    module: torch.nn.Module, args: tuple, path: Path, input_names, output_names, dynamic_axes: dict, opset: int
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about every Python-side shape comparison in diffusers (expected,
        # constant-folded branches), and torch warns that this exporter is the legacy one:
        # that choice is deliberate (module docstring).
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module.eval(),
            args,
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            do_constant_folding=True,
        )
    log.info("exported %s in %.1f s", path.name, time.monotonic() - started)
    return path


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(module.parameters())
    return param.device, param.dtype


def _placed(module: torch.nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> torch.nn.Module:
    """The module on `device` in `dtype`: itself when already there, else a copy (the caller's keeps its own)."""
    here, kind = _placement(module)
    if (device is None or torch.device(device) == here) and (dtype is None or dtype == kind):
        return module
    return copy.deepcopy(module).to(device or here, dtype or kind)


def external_data_path(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def example_inputs(
    family: Family, rows: int, height: int, width: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Tracing inputs in `input_names` order: random values of the real shapes and dtypes."""
    gen = torch.Generator().manual_seed(0)
    shapes = family.input_shapes(rows, height, width)
    args = []
    for name in family.input_names:
        if name == TIMESTEP_INPUT:
            x = torch.linspace(999, 1, rows) / family.timestep_divisor
        elif name in FLOAT32_INPUTS:
            x = torch.rand(shapes[name], generator=gen) * 8
        else:
            x = torch.randn(shapes[name], generator=gen)
        args.append(x.to(device, torch.float32 if name in FLOAT32_INPUTS else dtype))
    return tuple(args)


def _finish(traced: Path, path: Path, threshold: int) -> Path:
    """Rewrite the traced graph at `path`, its weights inline or in one external data file."""
    import onnx

    model = onnx.load(str(traced), load_external_data=True)
    weights = sum(len(t.raw_data) for t in model.graph.initializer)
    external = weights > threshold
    for stale in (path, external_data_path(path)):
        stale.unlink(missing_ok=True)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=external_data_path(path).name,
        size_threshold=1024,
    )
    log.info(
        "%s: %.1f MiB of weights%s",
        path.name,
        weights / 2**20,
        f", in {external_data_path(path).name}" if external else "",
    )
    return path


def _rms_norm(g: Any, x: Any, normalized_shape: list[int], weight: Any, eps: float | None) -> Any:
    """aten::rms_norm (torch.nn.RMSNorm: Flux's q/k norms) as plain ONNX ops, computed in float32.

    The TorchScript exporter has no symbolic for it (ONNX's RMSNormalization is opset 23);
    float32 statistics, as diffusers' own RMSNorm keeps them, spare fp16 graphs an overflow.
    """
    from torch.onnx import symbolic_helper

    x32 = g.op("Cast", x, to_i=1)  # 1: ONNX FLOAT
    axes = list(range(-len(normalized_shape), 0))
    mean = g.op("ReduceMean", g.op("Mul", x32, x32), axes_i=axes, keepdims_i=1)
    eps_value = g.op("Constant", value_t=torch.tensor(1e-6 if eps is None else eps, dtype=torch.float32))
    y = g.op("CastLike", g.op("Div", x32, g.op("Sqrt", g.op("Add", mean, eps_value))), x)
    return y if symbolic_helper._is_none(weight) else g.op("Mul", y, weight)


def _rotary(original: Any) -> Any:
    """diffusers' apply_rotary_emb with its (pairs of channels) split traceable for dynamic shapes.

    `x.reshape(*x.shape[:-1], -1, 2)` records the traced batch and sequence length as constants
    (a Flux graph then only runs at the traced size); `unflatten(-1, (-1, 2))` keeps them symbolic.
    Same arithmetic otherwise; other variants go to the original.
    """

    def apply_rotary_emb(
        x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1, sequence_dim: int = 2
    ) -> torch.Tensor:
        if not use_real or use_real_unbind_dim != -1 or sequence_dim not in (1, 2):
            return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = freqs_cis
        index = (None, slice(None), None, slice(None)) if sequence_dim == 1 else (None, None, slice(None), slice(None))
        cos, sin = cos[index].to(x.device), sin[index].to(x.device)
        x_real, x_imag = x.unflatten(-1, (-1, 2)).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)

    return apply_rotary_emb


@contextlib.contextmanager
def _traceable(opset: int) -> Iterator[None]:
    """What the tracer needs for the transformer families, for the duration of one export."""
    from diffusers.models.transformers import transformer_flux
    from torch.onnx import register_custom_op_symbolic, symbolic_helper, unregister_custom_op_symbolic

    register_custom_op_symbolic("aten::rms_norm", symbolic_helper.parse_args("v", "is", "v", "f")(_rms_norm), opset)
    original = transformer_flux.apply_rotary_emb
    transformer_flux.apply_rotary_emb = _rotary(original)
    try:
        yield
    finally:
        transformer_flux.apply_rotary_emb = original
        unregister_custom_op_symbolic("aten::rms_norm", opset)


def _export_via_tmp(
    module: torch.nn.Module,
    args: tuple,
    path: Path,
    input_names,
    output_names,
    dynamic_axes: dict,
    opset: int,
    threshold: int,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The tracer writes weights of a graph over 2 GB as one file per tensor: trace into a
    # scratch directory, then keep one graph file (and at most one data file).
    with tempfile.TemporaryDirectory(prefix=".export-", dir=path.parent) as tmp, _traceable(opset):
        traced = _export(module, args, Path(tmp) / path.name, input_names, output_names, dynamic_axes, opset)
        return _finish(traced, path, threshold)


def export_denoiser(
    family: Family,
    path: str | Path,
    *,
    rows: int = 2,
    height: int | None = None,
    width: int | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    opset: int = OPSET,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> Path:
    """Write the family's denoiser as ONNX with its dynamic axes.

    The graph's precision (and the tracing device) is `dtype` (`device`), by default the
    module's own; the family's module is left as it was. Timesteps, ids and guidance stay
    float32 inputs in every precision (diffusers builds their embeddings in float32).
    """
    started = time.monotonic()
    module = _placed(family.denoiser_module(), device, dtype)
    device, dtype = _placement(module)
    size = family.native_size // 4 // family.size_multiple * family.size_multiple or family.size_multiple
    args = example_inputs(family, rows, height or size, width or size, device, dtype)
    out = _export_via_tmp(
        module,
        args,
        Path(path),
        family.input_names,
        (PREDICTION,),
        family.dynamic_axes(),
        opset,
        external_data_threshold,
    )
    log.info("exported the %s denoiser in %.1f s", family.name, time.monotonic() - started)
    return out


def export_decoder(
    family: Family,
    path: str | Path,
    *,
    rows: int = 1,
    latent_height: int = 16,
    latent_width: int = 16,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    opset: int = OPSET,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> Path:
    """Write the family's latent decoder (VAE with its scaling and shift) as ONNX, dynamic batch and H/W;
    precision and device as for `export_denoiser`."""
    module = _placed(family.decoder_module(), device, dtype)
    device, dtype = _placement(module)
    latents = torch.randn(rows, family.latent_channels, latent_height, latent_width, device=device, dtype=dtype)
    dynamic = {
        VAE_INPUT: {0: "batch", 2: "height", 3: "width"},
        VAE_OUTPUT: {0: "batch", 2: "image_height", 3: "image_width"},
    }
    return _export_via_tmp(
        module, (latents,), Path(path), (VAE_INPUT,), (VAE_OUTPUT,), dynamic, opset, external_data_threshold
    )
