"""Model loading: an embedded tiny variant or a local diffusers directory, never the network.

A directory is dispatched on its model_index.json: the pipeline class picks the model family
(render/engine/families: SD 1.x/2.x, SDXL, SD3, Flux); any other class is refused by name before
anything loads. Each component the family needs is loaded with the class model_index.json
names, from its subfolder, with local files only; a missing, partial or corrupt component is
a ModelError that names it. Optional components the family can do without (SD3's T5) may be
null. The scheduler is not part of the model: only its config is loaded, and each image gets
its own scheduler from it (`from_config`), so jobs never share sampler state.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turbonode.config import TINY_MODELS
from turbonode.errors import TurbonodeError

if TYPE_CHECKING:
    from .families import Family


log = logging.getLogger(__name__)

# Components the worker never runs (safety checker, IP-Adapter image encoder): not loaded.
UNUSED_COMPONENTS = frozenset({"safety_checker", "feature_extractor", "image_encoder"})
LIBRARIES = ("diffusers", "transformers")  # component classes come from these two, never remote code


class ModelError(TurbonodeError):
    """The model could not be loaded (missing directory, unsupported pipeline, bad files)."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path} is missing: not a diffusers model directory") from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: {exc}") from None


def _dir_fingerprint(root: Path) -> str:
    """Hash of every config plus each weight file's name, size and mtime.

    Hashing gigabytes of weights at every start would cost seconds; a replaced weight file
    changes size or mtime, which is what the embedding cache needs to notice.
    """
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = str(path.relative_to(root))
        digest.update(rel.encode())
        if path.suffix == ".json":
            digest.update(path.read_bytes())
        else:
            st = path.stat()
            digest.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _component_class(root: Path, index: dict, name: str) -> type | None:
    """The class model_index.json names for a component; None where it is null (absent)."""
    entry = index.get(name)
    if entry is None or not isinstance(entry, list) or len(entry) != 2:
        raise ModelError(f"{root}/model_index.json: component {name!r} is missing or malformed ({entry!r})")
    library, class_name = entry
    if library is None and class_name is None:
        return None
    if library not in LIBRARIES:
        raise ModelError(
            f"{root}: component {name!r} comes from {library!r}; only {', '.join(LIBRARIES)} "
            "classes are loaded (no remote code)"
        )
    cls = getattr(importlib.import_module(library), str(class_name), None)
    if cls is None:
        raise ModelError(f"{root}: component {name!r} names {library}.{class_name}, which this {library} does not have")
    return cls


def _load_component(root: Path, name: str, cls: type) -> Any:
    if not (root / name).is_dir():
        raise ModelError(f"{root}: the {name}/ folder is missing (a partial download?)")
    try:
        # diffusers' models take low_cpu_mem_usage (on by default only with accelerate, else a
        # warning at every load); off, they loaded as fast and no larger (bench/model_load.py)
        options = {"low_cpu_mem_usage": False} if cls.__module__.startswith("diffusers.") else {}
        module = cls.from_pretrained(root, subfolder=name, local_files_only=True, **options)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - any failure here means unusable files; say which
        raise ModelError(
            f"{root}: cannot load {name} ({cls.__name__}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if hasattr(module, "eval"):
        module.eval().requires_grad_(False)
    return module


def _directory(root: Path) -> Family:
    from transformers.utils import logging as transformers_logging

    from .families import FAMILIES, ModelParts

    transformers_logging.disable_progress_bar()  # a bar per component at every start fills a daemon's log

    index = _read_json(root / "model_index.json")
    pipeline_class = index.get("_class_name")
    if pipeline_class not in FAMILIES:
        raise ModelError(
            f"{root}: {pipeline_class!r} pipelines are not served by this worker (it serves {', '.join(FAMILIES)})"
        )
    family = FAMILIES[pipeline_class]
    classes: dict[str, type | None] = {}
    for name in family.components:
        cls = _component_class(root, index, name)
        if cls is None:
            raise ModelError(f"{root}: {pipeline_class} needs a {name}, and model_index.json has none")
        classes[name] = cls
    for name in family.optional_components - UNUSED_COMPONENTS:
        if name in index:
            classes[name] = _component_class(root, index, name)
    denoiser = classes[family.denoiser_name].__name__  # type: ignore[union-attr]
    if denoiser != family.denoiser_class:
        raise ModelError(
            f"{root}: {pipeline_class} with a {denoiser} {family.denoiser_name} is not supported "
            f"(expected {family.denoiser_class})"
        )
    scheduler_config = _read_json(root / "scheduler" / "scheduler_config.json")
    modules = {name: None if cls is None else _load_component(root, name, cls) for name, cls in classes.items()}
    pipeline_config = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
    parts = ModelParts(
        pipeline_class=pipeline_class,
        modules=modules,
        scheduler_config=scheduler_config,
        pipeline_config=pipeline_config,
        model_id=str(root),
        fingerprint=_dir_fingerprint(root),
    )
    loaded = family(parts)
    log.info("loaded %s (%s family) from %s", pipeline_class, loaded.name, root)
    return loaded


def load_model(model: str) -> Family:
    """An embedded tiny variant (turbonode.config.TINY_MODELS) or a local diffusers directory."""
    from .families import family_for
    from .tiny import BUILDERS

    if model in TINY_MODELS:
        parts = BUILDERS[model]()
        return family_for(parts.pipeline_class)(parts)
    root = Path(model).expanduser()
    if not root.is_dir():
        raise ModelError(f"model {model!r} is neither one of {', '.join(TINY_MODELS)} nor a directory")
    return _directory(root.resolve())
