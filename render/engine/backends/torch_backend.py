"""The torch backend: the family's denoiser and VAE decoder in torch (CPU here, CUDA where present),
as traced graphs by default (render/engine/backends/graphs.py says why) or as eager modules."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from render.engine.families.base import FLOAT32_INPUTS, Family

from .base import Backend
from .graphs import GraphCache


def _place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    module = module.to(device)
    # diffusers logs a warning on every dtype cast, even a no-op one: cast only when needed.
    return module if next(module.parameters()).dtype == dtype else module.to(dtype)


class TorchBackend(Backend):
    """Runs the family's denoiser and VAE in torch: on CUDA in the family's half precision, fp32 on CPU.

    `decode` takes latents as the scheduler produced them and un-scales (and un-shifts) them
    itself, so callers never need to know the VAE's factors. With `graphs`, both run as traced
    graphs for the sizes `prepare`d (the worker prepares its default size at start), eagerly for others.
    """

    name = "torch"

    def __init__(self, family: Family, device: torch.device, *, graphs: bool = True):
        self.device = torch.device(device)
        self.dtype = family.cuda_dtype if self.device.type == "cuda" else torch.float32
        self.denoiser = _place(family.denoiser_module(), self.device, self.dtype)
        self.input_names = family.input_names
        # SDXL's VAE overflows in fp16 (its config says force_upcast): it decodes in fp32, as diffusers does
        self.decoder_dtype = torch.float32 if family.vae_needs_fp32(self.dtype) else self.dtype
        self.decoder = _place(family.decoder_module(), self.device, self.decoder_dtype)
        self.family = family
        self.graphs = graphs
        axes = family.dynamic_axes()
        batched = [axes[n].get(0) == "batch" for n in self.input_names]
        # without a prepared graph a cache runs its module eagerly: with graphs off none is prepared
        self._predict = GraphCache(self.denoiser, batched, f"{family.name} denoiser")
        self._decode = GraphCache(self.decoder, [True], f"{family.name} decoder")

    def _args(self, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return [self._placed(inputs[n], torch.float32 if n in FLOAT32_INPUTS else self.dtype) for n in self.input_names]

    def _placed(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # even a no-op .to() gives the GIL up and waits to get it back: skipped when nothing changes
        return tensor if tensor.dtype == dtype and tensor.device == self.device else tensor.to(self.device, dtype)

    @torch.inference_mode()
    def predict(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._predict(*self._args(inputs))

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self._decode(self._placed(latents, self.decoder_dtype))

    @torch.inference_mode()
    def prepare(self, height: int, width: int) -> None:
        """Trace the denoiser and decoder for height x width images (any row count runs through them)."""
        if not self.graphs:
            return
        family = self.family
        shapes = family.input_shapes(1, height, width)
        self._predict.prepare(*self._args({n: torch.zeros(shapes[n]) for n in self.input_names}))
        self._decode.prepare(self._placed(torch.zeros(family.noise_shape(height, width)), self.decoder_dtype))

    def describe(self) -> dict:
        graphs = {"graphs": len(self._predict) + len(self._decode)} if self.graphs else {}
        return {**super().describe(), "execution": "graph" if self.graphs else "eager", **graphs}
