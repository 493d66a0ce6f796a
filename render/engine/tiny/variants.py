"""Embedded tiny variants of SD 1.x, SDXL, SD3 and Flux: real diffusers/transformers modules from configs.

Built from render/engine/tiny/components.py's builders: nothing is downloaded, every weight is
seeded (the same on every machine), the tokenizers are built locally (CLIP's byte-level BPE
from components.py, T5's Unigram from a small piece list), and the shapes follow the real
models' structure at a fraction of their width: SDXL's two CLIP encoders (the second with a
projection for the pooled embedding) and a "text_time" UNet; SD3's three encoders, 16-channel
VAE with a shift and a patch-2 MMDiT; Flux's CLIP + T5, 16-channel VAE and a transformer fed
2x2-packed latents. Images are noise-like; every code path is the one a real checkpoint takes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from render.engine.families.base import ModelParts
from turbonode.config import TINY_MODELS

from . import components as sd_tiny

CLIP_DIM = sd_tiny.EMBED_DIM
T5_DIM = 32
T5_MAX_LENGTH = 32  # tokens; the real models take 256-512, which only costs time here


def t5_tokenizer() -> Any:
    """A T5 (Unigram, sentencepiece-style) tokenizer over printable ASCII, built in memory."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(c), -3.0) for c in range(ord("!"), ord("~") + 1)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def t5_encoder(vocab_size: int, offset: int, d_model: int = T5_DIM) -> Any:
    from transformers import T5Config, T5EncoderModel

    # T5 v1.1 (what SD3 and Flux use): gated-GELU feed-forward, relative position buckets.
    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    return sd_tiny.seeded(lambda: T5EncoderModel(config), offset)


def flow_vae(offset: int, *, scaling_factor: float, shift_factor: float) -> Any:
    """SD3/Flux's VAE layout: 16 latent channels, a shift, no quant convs."""
    return sd_tiny.build_vae(
        offset,
        latent_channels=16,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def weights_fingerprint(modules: list[Any]) -> str:
    """Content hash of the modules' weights: an embedded model's fingerprint (it keys the
    embedding cache and names the model's engines)."""
    digest = hashlib.sha256()
    for module in modules:
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _parts(
    name: str, pipeline_class: str, modules: dict[str, Any], scheduler_config: dict, **pipeline_config: Any
) -> ModelParts:
    weights = [m for m in modules.values() if isinstance(m, torch.nn.Module)]
    return ModelParts(
        pipeline_class=pipeline_class,
        modules=modules,
        scheduler_config=scheduler_config,
        pipeline_config=pipeline_config,
        model_id=name,
        fingerprint=f"{name}-{weights_fingerprint(weights)}",
    )


def sd() -> ModelParts:
    """The SD 1.x `tiny`, from components.py as it is."""
    tokenizer = sd_tiny.build_tokenizer()
    modules = {
        "unet": sd_tiny.build_unet(),
        "vae": sd_tiny.build_vae(),
        "text_encoder": sd_tiny.build_text_encoder(len(tokenizer)),
        "tokenizer": tokenizer,
    }
    return _parts("tiny", "StableDiffusionPipeline", modules, dict(sd_tiny.SCHEDULER_CONFIG))


# SDXL's own scheduler config (EulerDiscreteScheduler, SD's noise schedule, "leading" spacing).
SDXL_SCHEDULER = {
    **{k: v for k, v in sd_tiny.SCHEDULER_CONFIG.items() if k not in ("clip_sample", "set_alpha_to_one")},
    "_class_name": "EulerDiscreteScheduler",
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
}


def sdxl() -> ModelParts:
    tokenizer, tokenizer_2 = sd_tiny.build_tokenizer(), sd_tiny.build_tokenizer()
    time_dim = 8
    unet = sd_tiny.build_unet(
        13,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
        # both encoders' hidden states side by side; the pooled embedding and six size numbers added to time
        cross_attention_dim=2 * CLIP_DIM,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + CLIP_DIM,
    )
    modules = {
        "unet": unet,
        "vae": sd_tiny.build_vae(14, scaling_factor=0.13025),
        "text_encoder": sd_tiny.build_text_encoder(len(tokenizer), 11),
        "tokenizer": tokenizer,
        "text_encoder_2": sd_tiny.build_text_encoder(len(tokenizer_2), 12, projection=True),
        "tokenizer_2": tokenizer_2,
    }
    return _parts(
        "tiny-sdxl", "StableDiffusionXLPipeline", modules, dict(SDXL_SCHEDULER), force_zeros_for_empty_prompt=True
    )


SD3_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def sd3(*, t5: bool = True) -> ModelParts:
    from diffusers import SD3Transformer2DModel

    tokenizer, tokenizer_2 = sd_tiny.build_tokenizer(), sd_tiny.build_tokenizer()
    # The joint width is T5's; the two CLIP encoders' hidden states (2 x 32) are zero-padded up to it.
    joint = 48
    transformer = sd_tiny.seeded(
        lambda: SD3Transformer2DModel(
            sample_size=sd_tiny.IMAGE_SIZE // 8,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=joint,
            pooled_projection_dim=2 * CLIP_DIM,
            pos_embed_max_size=64,
        ),
        21,
    )
    modules: dict[str, Any] = {
        "transformer": transformer,
        "vae": flow_vae(22, scaling_factor=1.5305, shift_factor=0.0609),
        "text_encoder": sd_tiny.build_text_encoder(len(tokenizer), 23, projection=True),
        "tokenizer": tokenizer,
        "text_encoder_2": sd_tiny.build_text_encoder(len(tokenizer_2), 24, projection=True),
        "tokenizer_2": tokenizer_2,
        "text_encoder_3": None,
        "tokenizer_3": None,
    }
    if t5:
        tokenizer_3 = t5_tokenizer()
        modules.update(text_encoder_3=t5_encoder(len(tokenizer_3), 25, d_model=joint), tokenizer_3=tokenizer_3)
    return _parts("tiny-sd3" if t5 else "tiny-sd3-no-t5", "StableDiffusion3Pipeline", modules, dict(SD3_SCHEDULER))


# FLUX.1-schnell's scheduler: no resolution-dependent shift (dev's sets use_dynamic_shifting and shift 3).
FLUX_SCHNELL_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
}
FLUX_DEV_SCHEDULER = {**FLUX_SCHNELL_SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True}


def flux(*, guidance_embeds: bool = False) -> ModelParts:
    """Flux-schnell-like by default; guidance_embeds=True gives a guidance-distilled (dev-like) one.

    The transformer is the widest tiny denoiser (8 heads, 2 + 4 blocks, ~2 M parameters) so that,
    as in the real model, a step costs more than the VAE decode: a narrower one left the tiny
    Flux VAE-bound, and a benchmark of the scheduler would have measured the VAE."""
    from diffusers import FluxTransformer2DModel

    tokenizer, tokenizer_2 = sd_tiny.build_tokenizer(), t5_tokenizer()
    transformer = sd_tiny.seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=16,
            num_attention_heads=8,
            joint_attention_dim=T5_DIM,
            pooled_projection_dim=CLIP_DIM,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 6, 6),
        ),
        31 + guidance_embeds,
    )
    modules = {
        "transformer": transformer,
        "vae": flow_vae(33, scaling_factor=0.3611, shift_factor=0.1159),
        "text_encoder": sd_tiny.build_text_encoder(len(tokenizer), 34),
        "tokenizer": tokenizer,
        "text_encoder_2": t5_encoder(len(tokenizer_2), 35),
        "tokenizer_2": tokenizer_2,
    }
    name = "tiny-flux-dev" if guidance_embeds else "tiny-flux"
    return _parts(
        name, "FluxPipeline", modules, dict(FLUX_DEV_SCHEDULER if guidance_embeds else FLUX_SCHNELL_SCHEDULER)
    )


# the names `--model` takes (turbonode.config.TINY_MODELS) -> their builders
BUILDERS: dict[str, Callable[[], ModelParts]] = dict(zip(TINY_MODELS, (sd, sdxl, sd3, flux), strict=True))
