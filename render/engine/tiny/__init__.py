"""The embedded tiny models (`worker.model = "tiny"`, "tiny-sdxl", ...): real diffusers and
transformers modules built from configs with seeded weights, nothing downloaded.

components.py builds the SD 1.x parts every variant shares (CLIP tokenizer and encoder, UNet,
VAE, the noise schedule); variants.py assembles them, with T5 and the MMDiT/Flux transformers,
into each variant's ModelParts.
"""

from __future__ import annotations

from .variants import BUILDERS

__all__ = ["BUILDERS"]
