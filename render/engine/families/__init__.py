"""Model families the worker serves: SD 1.x/2.x, SDXL, SD3, Flux (render/engine/families/base.py says how).

`FAMILIES` maps the diffusers pipeline class a model_index.json names to the family that
serves it; `TINY` names the embedded tiny variants built from configs.
"""

from __future__ import annotations

from .base import PREDICTION, Family, FamilyError, ModelParts
from .flux import Flux
from .sd import StableDiffusion
from .sd3 import StableDiffusion3
from .sdxl import StableDiffusionXL

FAMILIES: dict[str, type[Family]] = {
    cls.pipeline_class: cls for cls in (StableDiffusion, StableDiffusionXL, StableDiffusion3, Flux)
}


def family_for(pipeline_class: str) -> type[Family]:
    try:
        return FAMILIES[pipeline_class]
    except KeyError:
        raise FamilyError(
            f"{pipeline_class!r} is not served by this worker (it serves {', '.join(FAMILIES)})"
        ) from None


__all__ = [
    "FAMILIES",
    "PREDICTION",
    "Family",
    "FamilyError",
    "Flux",
    "ModelParts",
    "StableDiffusion",
    "StableDiffusion3",
    "StableDiffusionXL",
    "family_for",
]
