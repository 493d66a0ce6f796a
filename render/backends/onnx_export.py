"""Export the UNet and the VAE decoder to ONNX, the input of the TensorRT engine builder.

The exported graphs take exactly what `Backend.predict_noise` and `Backend.decode` take:
a batch of latents, one timestep per sample, one embedding sequence per sample. Batch,
latent height/width and text length are dynamic axes, so one file serves every
optimisation profile.

Exporter choice: the TorchScript tracer (`dynamo=False`), not torch 2.13's default dynamo
exporter. The dynamo exporter needs onnxscript, which the lean install does not have (and
the checked environment lacks), and `torch.export` with explicit symbolic-dimension ranges,
against which diffusers' Python-side shape branches (e.g. the up-sampling size check) are a
risk. The tracer records the shape arithmetic as Shape ops that the TensorRT ONNX parser
resolves per profile; it is the exporter NVIDIA's Stable Diffusion demos have used. Tested
here: batch, H and W stay dynamic and the graph matches torch to ~1e-6 (fp32).

Precision lives in the graph: TensorRT 11 builds strongly typed networks only (no FP16
builder flag), so an fp16 engine is built from a graph exported in fp16.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

OPSET = 17  # first opset with LayerNormalization; TensorRT 10/11 parse up to 20+
UNET_INPUTS = ("sample", "timestep", "encoder_hidden_states")
UNET_OUTPUT = "noise"
VAE_INPUT = "latents"
VAE_OUTPUT = "images"


class UNetForExport(torch.nn.Module):
    """The UNet as a plain (sample, timestep[B], embeddings) -> noise function."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


class VAEDecoderForExport(torch.nn.Module):
    """Latents as the scheduler produced them -> images, exactly what `TorchBackend.decode` computes."""

    def __init__(self, vae: Any):  # a diffusers AutoencoderKL
        super().__init__()
        self.vae = vae
        self.scale = float(vae.config.scaling_factor)

    def forward(self, latents):
        return self.vae.decode(latents / self.scale, return_dict=False)[0]


@dataclass(frozen=True)
class ExportShape:
    """Example shapes for tracing; the exported axes stay dynamic."""

    batch: int = 2
    latent_height: int = 64
    latent_width: int = 64
    text_len: int = 77


DEFAULT_SHAPE = ExportShape()


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


def export_unet(unet: Any, path: str | Path, *, shape: ExportShape = DEFAULT_SHAPE, opset: int = OPSET) -> Path:
    """Write the UNet as ONNX with dynamic batch, latent H/W and text length.

    The graph's precision and the tracing device are the module's own (move it first).
    The timestep input is float32 [B] in every precision: diffusers computes the sinusoidal
    embedding in float32 and casts it to the sample dtype itself.
    """
    device, dtype = _placement(unet)
    cfg = unet.config
    b, h, w = shape.batch, shape.latent_height, shape.latent_width
    sample = torch.randn(b, cfg.in_channels, h, w, device=device, dtype=dtype)
    timestep = torch.linspace(1, 999, b, device=device, dtype=torch.float32)
    ehs = torch.randn(b, shape.text_len, cfg.cross_attention_dim, device=device, dtype=dtype)
    dynamic = {
        "sample": {0: "batch", 2: "height", 3: "width"},
        "timestep": {0: "batch"},
        "encoder_hidden_states": {0: "batch", 1: "text_len"},
        UNET_OUTPUT: {0: "batch", 2: "height", 3: "width"},
    }
    return _export(
        UNetForExport(unet), (sample, timestep, ehs), Path(path), UNET_INPUTS, (UNET_OUTPUT,), dynamic, opset
    )


def export_vae_decoder(vae: Any, path: str | Path, *, shape: ExportShape = DEFAULT_SHAPE, opset: int = OPSET) -> Path:
    """Write the VAE decoder (with the latent scaling) as ONNX, dynamic batch and H/W."""
    device, dtype = _placement(vae)
    latents = torch.randn(
        shape.batch, vae.config.latent_channels, shape.latent_height, shape.latent_width, device=device, dtype=dtype
    )
    dynamic = {
        VAE_INPUT: {0: "batch", 2: "height", 3: "width"},
        VAE_OUTPUT: {0: "batch", 2: "image_height", 3: "image_width"},
    }
    return _export(VAEDecoderForExport(vae), (latents,), Path(path), (VAE_INPUT,), (VAE_OUTPUT,), dynamic, opset)
