"""Model loading: the embedded `tiny` set or a local diffusers directory, never the network.

The scheduler is not part of the model here: only its config is loaded, and the engine
builds one scheduler per job from it (`from_config`), so jobs never share sampler state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbonode.errors import TurbonodeError


class ModelError(TurbonodeError):
    """The model could not be loaded (missing directory, unsupported pipeline, bad files)."""


@dataclass
class Components:
    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    scheduler_config: dict
    model_id: str  # what the user asked for: 'tiny' or the directory
    fingerprint: str  # changes when the weights change; keys the text-embedding cache
    native_size: int  # pixels the model was trained at
    extra: dict = field(default_factory=dict)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


def _tiny() -> Components:
    from . import tiny

    tokenizer = tiny.build_tokenizer()
    unet, vae = tiny.build_unet(), tiny.build_vae()
    text_encoder = tiny.build_text_encoder(len(tokenizer))
    digest = hashlib.sha256()
    for module in (unet, vae, text_encoder):
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().numpy().tobytes())
    return Components(
        unet,
        vae,
        text_encoder,
        tokenizer,
        dict(tiny.SCHEDULER_CONFIG),
        "tiny",
        "tiny-" + digest.hexdigest()[:16],
        tiny.IMAGE_SIZE,
    )


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


def _directory(root: Path) -> Components:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    index = _read_json(root / "model_index.json")
    if "text_encoder_2" in index:
        raise ModelError(
            f"{root}: two-text-encoder pipelines ({index.get('_class_name')}, e.g. SDXL) "
            "need pooled embeddings and time ids, which this worker does not support yet"
        )
    scheduler_config = _read_json(root / "scheduler" / "scheduler_config.json")
    try:
        unet = UNet2DConditionModel.from_pretrained(root, subfolder="unet", local_files_only=True)
        vae = AutoencoderKL.from_pretrained(root, subfolder="vae", local_files_only=True)
        text_encoder = CLIPTextModel.from_pretrained(root, subfolder="text_encoder", local_files_only=True)
        tokenizer = CLIPTokenizer.from_pretrained(root, subfolder="tokenizer", local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{root}: cannot load: {exc}") from None
    for module in (unet, vae, text_encoder):
        module.eval().requires_grad_(False)
    native = unet.config.sample_size * 2 ** (len(vae.config.block_out_channels) - 1)
    return Components(unet, vae, text_encoder, tokenizer, scheduler_config, str(root), _dir_fingerprint(root), native)


def load_components(model: str) -> Components:
    """'tiny' -> the embedded model; anything else is a local diffusers directory."""
    if model == "tiny":
        return _tiny()
    root = Path(model).expanduser()
    if not root.is_dir():
        raise ModelError(f"model {model!r} is neither 'tiny' nor a directory")
    return _directory(root.resolve())
