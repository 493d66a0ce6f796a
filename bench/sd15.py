"""Stable Diffusion 1.5-sized components from configs, random weights (for GPU benchmarks).

A lent GPU machine cannot download a checkpoint; the architecture, not the weights, sets
the speed. The tokenizer is the embedded tiny one (render/engine/tiny/components.py): it only sizes the text
encoder's embedding table, which does not change the encoder's cost.
"""

from __future__ import annotations

UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
    block_out_channels=(128, 256, 512, 512),
    sample_size=512,
    scaling_factor=0.18215,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)
TEXT = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
)
FINGERPRINT = "bench-sd15-seed0"  # same weights every run: engines built once are reused from the cache
IMAGE_SIZE = 512


def _on(device, build, seed: int):
    import torch

    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: ~1 B parameters are slow to init on a CPU
        module = build()
    return module.to(dtype=torch.float16).eval().requires_grad_(False)


def build_unet(device):
    from diffusers import UNet2DConditionModel

    return _on(device, lambda: UNet2DConditionModel(**UNET), 0)


def model(device):
    """The SD 1.x family (render/engine/families/sd.py) with SD-1.5-sized UNet, VAE and CLIP text encoder."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from render.engine.families import ModelParts, StableDiffusion
    from render.engine.tiny import components as tiny

    tokenizer = tiny.build_tokenizer()
    n = len(tokenizer)
    text = CLIPTextConfig(vocab_size=n, bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1, **TEXT)
    modules = {
        "unet": build_unet(device),
        "vae": _on(device, lambda: AutoencoderKL(**VAE), 1),
        "text_encoder": _on(device, lambda: CLIPTextModel(text), 2),
        "tokenizer": tokenizer,
    }
    parts = ModelParts("StableDiffusionPipeline", modules, dict(tiny.SCHEDULER_CONFIG), {}, "sd15-random", FINGERPRINT)
    family = StableDiffusion(parts)
    assert family.native_size == IMAGE_SIZE
    return family
