"""The embedded SD 1.x components: a real Stable Diffusion component set built from configs (the
builders every tiny variant in render/engine/tiny/variants.py shares).

Nothing is downloaded: the UNet, VAE and CLIP text encoder are diffusers/transformers
models with seeded random weights (the same on every machine and every run), and the CLIP
tokenizer is a byte-level BPE built from a vocab.json/merges.txt written to a temporary
directory. Images are noise-like, but every code path (tokenize, encode, batched UNet,
per-job scheduler steps, VAE decode) is the one a real checkpoint takes.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SEED = 20261202
MAX_LENGTH = 77
EMBED_DIM = 32
IMAGE_SIZE = 256  # native size; the UNet is convolutional and takes any multiple of 8 pixels

# The Stable Diffusion 1.x noise schedule: what every SD-family scheduler config carries.
SCHEDULER_CONFIG = {
    "_class_name": "DDIMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable-character table (BPE's base alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_files(directory: Path) -> None:
    """Write a byte-level CLIP vocabulary (every byte, alone and word-final) without merges."""
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\n")


def build_tokenizer():
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="turbonode-tok-") as tmp:
        tokenizer_files(Path(tmp))
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=MAX_LENGTH, local_files_only=True)


def seeded(build: Callable[[], Any], offset: int) -> Any:
    """Build one module under its own seed without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + offset)
        return build().eval().requires_grad_(False)


def build_unet(offset: int = 1, **overrides: Any) -> Any:
    """SD's two-block UNet; `overrides` add what a family's UNet has on top (SDXL's added embeddings)."""
    from diffusers import UNet2DConditionModel

    config = {
        "sample_size": IMAGE_SIZE // 8,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": (32, 64),
        "layers_per_block": 2,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
        "cross_attention_dim": EMBED_DIM,
    }
    return seeded(lambda: UNet2DConditionModel(**{**config, **overrides}), offset)


def build_vae(offset: int = 2, **overrides: Any) -> Any:
    """Four blocks give the real 8x latent scale; narrow channels keep a 256 px decode ~50 ms on CPU.

    `overrides` give SD3/Flux their 16 latent channels, scaling and shift factors."""
    from diffusers import AutoencoderKL

    config = {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": (16, 16, 32, 32),
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "latent_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 16,
        "sample_size": IMAGE_SIZE,
    }
    return seeded(lambda: AutoencoderKL(**{**config, **overrides}), offset)


def build_text_encoder(vocab_size: int, offset: int = 3, *, projection: bool = False) -> Any:
    """A 5-layer CLIP text encoder; `projection` adds the text projection SDXL/SD3 pool with."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=EMBED_DIM,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=5,
        max_position_embeddings=MAX_LENGTH,
        layer_norm_eps=1e-5,
        projection_dim=EMBED_DIM,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return seeded(lambda: cls(config), offset)
