"""What every model family shares, in diffusers' stage names: encode prompt, prepare latents, denoise, decode.

A family (SD 1.x/2.x, SDXL, SD3, Flux) knows how its pipeline conditions the denoiser, and
nothing about jobs, tiers or devices:

- *encode prompt*: one `Conditioning` per prompt, every encoder's output (pooled ones too),
  as the per-prompt tensors the denoiser takes (no batch dimension). It depends on the
  prompt and the weights only, so a cache may keep it under (fingerprint, prompt).
- *prepare latents*: a `Denoising` per image: its own scheduler (built from the model's
  scheduler config), initial noise drawn on the CPU from the image's seed (the same image on
  any device), in the family's layout (Flux: 2x2 patches packed into a sequence).
- *denoise*: `denoiser_inputs` turns images at any mix of progress, steps, prompts and
  guidance into ONE batch of named tensors (per-row timesteps, per-row conditioning, SDXL
  time ids, Flux ids and guidance); `finish_step` applies classifier-free guidance per image
  and steps each image's scheduler on its own slice. The denoiser itself is a plain module
  over those named tensors (`denoiser_module`): the torch backend calls it, the ONNX export
  traces it, a TensorRT engine built from that graph takes the same names.
- *decode*: `vae_input` undoes the family's layout; `decoder_module` applies the VAE's
  scaling/shift and decodes to images in [-1, 1].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from turbonode.errors import TurbonodeError
from turbonode.tiers import PRIORITY_ORDER

Conditioning = dict[str, torch.Tensor]  # input name -> one prompt's tensor (no batch dimension)
Predict = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]

# The denoiser's and the decoder's tensor names (the torch modules' arguments, the ONNX graphs' inputs).
LATENT_INPUT, TIMESTEP_INPUT, EHS = "sample", "timestep", "encoder_hidden_states"
POOLED = "pooled_projections"  # SD3/Flux; SDXL calls its pooled embedding text_embeds
TEXT_EMBEDS, TIME_IDS = "text_embeds", "time_ids"  # SDXL's added conditioning
GUIDANCE, IMG_IDS, TXT_IDS = "guidance", "img_ids", "txt_ids"  # Flux's guidance embedding and position ids
PREDICTION = "prediction"  # what the denoiser outputs: noise (SD, SDXL) or flow velocity (SD3, Flux)
VAE_INPUT, VAE_OUTPUT = "latents", "images"
# Inputs kept in float32 in every precision: diffusers builds sinusoidal/rotary embeddings
# from them in float32 and casts the result to the model's dtype itself.
FLOAT32_INPUTS = frozenset({TIMESTEP_INPUT, GUIDANCE, TIME_IDS, IMG_IDS, TXT_IDS})


class FamilyError(TurbonodeError, ValueError):
    """A request the family cannot serve (a sampler it has no use for, a size it cannot render)."""


@dataclass
class ModelParts:
    """A loaded model: its modules under diffusers' component names, and where they came from."""

    pipeline_class: str  # the diffusers pipeline model_index.json names: picks the family
    modules: dict[str, Any]  # "unet"/"transformer", "vae", "text_encoder", "tokenizer", ... (None: absent)
    scheduler_config: dict
    pipeline_config: dict  # model_index.json's own settings (e.g. force_zeros_for_empty_prompt)
    model_id: str  # what the user asked for: a tiny name or the directory
    fingerprint: str  # changes when the weights change


@dataclass(frozen=True)
class TierDefaults:
    """Per-tier steps, guidance and sampler that suit a family's checkpoints."""

    steps: Mapping[str, int]
    guidance: Mapping[str, float]
    sampler: Mapping[str, str]

    @classmethod
    def table(cls, steps: tuple[int, ...], guidance: tuple[float, ...], sampler: tuple[str, ...]) -> TierDefaults:
        """From values in tier priority order (turbo, fast, other, relax)."""
        return cls(
            dict(zip(PRIORITY_ORDER, steps, strict=True)),
            dict(zip(PRIORITY_ORDER, guidance, strict=True)),
            dict(zip(PRIORITY_ORDER, sampler, strict=True)),
        )


@dataclass(eq=False)
class Denoising:
    """One image on its way: what it is conditioned on, its scheduler, latents and noise generator."""

    cond: Conditioning
    uncond: Conditioning | None  # the negative row, present only with classifier-free guidance
    guidance: float
    height: int
    width: int
    scheduler: Any
    latents: torch.Tensor  # [1, ...] in the family's layout, on the denoiser's device
    generator: torch.Generator | None  # CPU: ancestral samplers draw their noise from it too
    step: int = 0
    extra: dict = field(default_factory=dict)
    released_steps: int | None = None  # total_steps once released: the scheduler is gone then

    @property
    def rows(self) -> int:
        """Denoiser rows this image takes per step: 2 with classifier-free guidance."""
        return 1 if self.uncond is None else 2

    @property
    def total_steps(self) -> int:
        if self.released_steps is not None:
            return self.released_steps
        return len(self.scheduler.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.step]

    def release(self) -> None:
        """Drop the tensors, scheduler and generator once the image is decoded; the step counts
        stay for the job's record. A worker keeps a thousand finished jobs (render/engine/job_table.py):
        what each holds past its end stays in the heap for good and fragments it."""
        self.released_steps = self.total_steps
        self.latents, self.cond, self.uncond = torch.empty(0), {}, None
        self.scheduler, self.generator, self.extra = None, None, {}


class LatentDecoder(torch.nn.Module):
    """Latents as the scheduler left them ([B, C, H, W]) -> images in [-1, 1].

    Undoes the VAE's normalisation the way each pipeline does: SD/SDXL divide by the scaling
    factor (SDXL variants with latents_mean/std de-standardise instead), SD3/Flux also add the
    shift factor.
    """

    mean: torch.Tensor | None
    std: torch.Tensor | None

    def __init__(self, vae: Any):
        super().__init__()
        self.vae: Any = vae
        cfg = vae.config
        self.scale = float(cfg.scaling_factor)
        self.shift = float(getattr(cfg, "shift_factor", None) or 0.0)
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        shape = (1, cfg.latent_channels, 1, 1)
        # buffers: they follow the module to its device and dtype
        self.register_buffer("mean", torch.tensor(mean).view(shape) if mean and std else None, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(shape) if mean and std else None, persistent=False)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        if self.mean is not None and self.std is not None:
            latents = latents * self.std.to(latents.dtype) / self.scale + self.mean.to(latents.dtype)
        else:
            latents = latents / self.scale + self.shift
        return self.vae.decode(latents, return_dict=False)[0]


class Denoiser(torch.nn.Module):
    """A diffusers UNet or transformer as a function of the family's inputs, positional in `input_names` order.

    That flat signature is what the torch backend calls, what the ONNX graph is traced from and
    what a TensorRT engine built from it takes. `rename` maps an input to the model's keyword
    (the latents are `sample` here and `hidden_states` to the transformers); inputs in `added`
    go to the UNet's added_cond_kwargs (SDXL's text_embeds and time_ids).
    """

    def __init__(
        self,
        model: Any,
        input_names: tuple[str, ...],
        rename: Mapping[str, str] | None = None,
        added: tuple[str, ...] = (),
    ):
        super().__init__()
        self.model: Any = model
        self.input_names, self.rename, self.added = input_names, dict(rename or {}), added

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.input_names, args, strict=True))
        kwargs: dict[str, Any] = {self.rename.get(k, k): v for k, v in named.items() if k not in self.added}
        if self.added:
            kwargs["added_cond_kwargs"] = {k: named[k] for k in self.added}
        return self.model(**kwargs, return_dict=False)[0]

    def call(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run on `denoiser_inputs`' dict."""
        return self(*(inputs[name] for name in self.input_names))


def tokens(tokenizer: Any, prompts: list[str], length: int) -> torch.Tensor:
    """Token ids padded/truncated to `length`, as every diffusers pipeline tokenizes."""
    return tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class Family(ABC):
    """One model family: how its pipeline encodes, prepares, denoises and decodes."""

    name: ClassVar[str]  # "sd", "sdxl", "sd3", "flux"
    pipeline_class: ClassVar[str]  # the diffusers pipeline in model_index.json
    denoiser_name: ClassVar[str]  # "unet" or "transformer"
    denoiser_class: ClassVar[str]  # the diffusers model class it must be
    components: ClassVar[tuple[str, ...]]  # what model_index.json must name (besides the scheduler)
    optional_components: ClassVar[frozenset[str]] = frozenset()
    conditioning_inputs: ClassVar[tuple[str, ...]]  # per-prompt denoiser inputs `encode_prompts` returns
    samplers: ClassVar[tuple[str, ...]]
    cuda_dtype: ClassVar[torch.dtype] = torch.float16  # half precision on a GPU (bf16 where fp16 overflows)
    uses_cfg: ClassVar[bool] = True  # guidance > 1 adds an unconditional row (not for guidance-distilled Flux)
    timestep_divisor: ClassVar[float] = 1.0  # the pipeline hands the denoiser the scheduler's timestep / this

    def __init__(self, parts: ModelParts):
        self.parts = parts

    # ---- components -------------------------------------------------------------------

    def module(self, name: str) -> Any:
        return self.parts.modules.get(name)

    @property
    def denoiser(self) -> Any:
        return self.parts.modules[self.denoiser_name]

    @property
    def vae(self) -> Any:
        return self.parts.modules["vae"]

    @property
    def text_encoders(self) -> list[Any]:
        """The text encoder modules this model has (SD3 may lack its T5)."""
        return [m for k, m in self.parts.modules.items() if k.startswith("text_encoder") and m is not None]

    @property
    def model_id(self) -> str:
        return self.parts.model_id

    @property
    def fingerprint(self) -> str:
        return self.parts.fingerprint

    @property
    def scheduler_config(self) -> dict:
        return self.parts.scheduler_config

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.latent_channels)

    @property
    @abstractmethod
    def size_multiple(self) -> int:
        """Image sides must be multiples of this (VAE scale times the denoiser's downsampling/patching)."""

    @property
    @abstractmethod
    def native_size(self) -> int:
        """Pixels the model was trained at (the worker's default size)."""

    @property
    @abstractmethod
    def defaults(self) -> TierDefaults:
        """Per-tier steps, guidance and sampler for this kind of checkpoint (docs/worker.md lists them)."""

    def describe(self) -> dict:
        return {
            "family": self.name,
            "pipeline": self.pipeline_class,
            "model": self.model_id,
            "fingerprint": self.fingerprint,
            "native_size": self.native_size,
        }

    # ---- encode prompt ----------------------------------------------------------------

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> list[Conditioning]:
        """One Conditioning per prompt (all encoders, pooled too), on the text encoders' device."""

    def cfg_for(self, guidance: float) -> bool:
        """Does an image at this guidance take an unconditional row? (<= 1 turns guidance off.)"""
        return self.uses_cfg and guidance > 1.0

    # ---- prepare latents --------------------------------------------------------------

    def check_sampler(self, sampler: str) -> None:
        if sampler not in self.samplers:
            raise FamilyError(
                f"sampler {sampler!r} does not apply to {self.name} models (they take {', '.join(self.samplers)})"
            )

    @abstractmethod
    def make_scheduler(self, sampler: str, steps: int, height: int, width: int) -> Any:
        """A fresh scheduler for one image, timesteps set for `steps` at this size."""

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one image's initial noise, as the pipeline draws it (before any packing)."""
        return (1, self.latent_channels, *self.latent_size(height, width))

    def pack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[1, C, h, w] -> the family's latent layout (identity but for Flux)."""
        return latents

    def vae_input(self, d: Denoising) -> torch.Tensor:
        """An image's final latents as the VAE takes them, [1, C, h, w]."""
        return d.latents

    def start(
        self,
        *,
        cond: Conditioning,
        uncond: Conditioning | None,
        guidance: float,
        seed: int,
        height: int,
        width: int,
        sampler: str,
        steps: int,
        device: torch.device | str = "cpu",
    ) -> Denoising:
        """Prepare one image: its scheduler, and noise drawn on the CPU from its seed."""
        if height % self.size_multiple or width % self.size_multiple:
            raise FamilyError(
                f"{width}x{height} is not a multiple of {self.size_multiple} pixels ({self.name} models need that)"
            )
        scheduler = self.make_scheduler(sampler, steps, height, width)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(self.noise_shape(height, width), generator=generator, dtype=torch.float32)
        latents = self.pack(noise, height, width) * getattr(scheduler, "init_noise_sigma", 1.0)
        return Denoising(
            cond=cond,
            uncond=uncond if self.cfg_for(guidance) else None,
            guidance=guidance,
            height=height,
            width=width,
            scheduler=scheduler,
            latents=latents.to(device),
            generator=generator,
        )

    # ---- denoise ----------------------------------------------------------------------

    @property
    def input_names(self) -> tuple[str, ...]:
        """The denoiser's inputs, in `denoiser_module`'s argument order."""
        return (LATENT_INPUT, TIMESTEP_INPUT, *self.conditioning_inputs, *self.extra_input_names)

    @property
    def extra_input_names(self) -> tuple[str, ...]:
        return ()

    def extra_inputs(self, owners: list[Denoising]) -> dict[str, torch.Tensor]:
        """Inputs built from each row's image rather than its prompt (SDXL time ids, Flux ids/guidance)."""
        return {}

    def denoiser_inputs(self, batch: list[Denoising]) -> dict[str, torch.Tensor]:
        """One batch of named tensors for images at any progress: 1 or 2 rows per image, uncond first."""
        latents, timesteps, conds, owners = [], [], [], []
        for d in batch:
            rows = [d.uncond, d.cond] if d.uncond is not None else [d.cond]
            t = d.timestep
            x = torch.cat([d.latents] * len(rows))
            if hasattr(d.scheduler, "scale_model_input"):
                x = d.scheduler.scale_model_input(x, t)
            latents.append(x)
            timesteps.append(torch.full((len(rows),), float(t), dtype=torch.float32) / self.timestep_divisor)
            conds += rows
            owners += [d] * len(rows)
        device = latents[0].device
        inputs = {LATENT_INPUT: torch.cat(latents), TIMESTEP_INPUT: torch.cat(timesteps).to(device)}
        for name in self.conditioning_inputs:
            inputs[name] = torch.stack([c[name] for c in conds]).to(device)  # type: ignore[index]
        inputs.update({k: v.to(device) for k, v in self.extra_inputs(owners).items()})
        return inputs

    def finish_step(self, batch: list[Denoising], prediction: torch.Tensor) -> None:
        """Guidance per image, then each image's own scheduler steps its slice of the prediction."""
        prediction = prediction.float()
        offset = 0
        for d in batch:
            pred = prediction[offset : offset + d.rows]
            offset += d.rows
            if d.uncond is not None:
                uncond, cond = pred.chunk(2)
                pred = uncond + d.guidance * (cond - uncond)
            d.latents = d.scheduler.step(pred, d.timestep, d.latents, generator=d.generator, return_dict=False)[0]
            d.step += 1

    def step(self, batch: list[Denoising], predict: Predict) -> int:
        """One denoising step for every image in `batch`: ONE denoiser call; returns its rows."""
        inputs = self.denoiser_inputs(batch)
        self.finish_step(batch, predict(inputs))
        return int(inputs[LATENT_INPUT].shape[0])

    denoiser_rename: ClassVar[Mapping[str, str]] = {}
    denoiser_added: ClassVar[tuple[str, ...]] = ()

    def denoiser_module(self) -> Denoiser:
        """The denoiser as a plain function of `input_names` (positional) -> a prediction shaped like the latents."""
        return Denoiser(self.denoiser, self.input_names, self.denoiser_rename, self.denoiser_added)

    @abstractmethod
    def row_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Shape of each per-row input for height x width images, without the batch axis."""

    def shared_shapes(self, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Inputs shared by every row of a batch (Flux's position ids)."""
        return {}

    def input_shapes(self, rows: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Shape of every denoiser input for `rows` rows of height x width images (export, engine profiles)."""
        shapes = {name: (rows, *shape) for name, shape in self.row_shapes(height, width).items()}
        return {name: {**shapes, **self.shared_shapes(height, width)}[name] for name in self.input_names}

    latent_axes: ClassVar[Mapping[int, str]] = {2: "height", 3: "width"}
    shared_axes: ClassVar[Mapping[str, Mapping[int, str]]] = {}

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """Which axes of each input (and of the output) vary: batch, latent size, text length."""
        axes: dict[str, dict[int, str]] = {name: {0: "batch"} for name in self.input_names}
        axes[LATENT_INPUT].update(self.latent_axes)
        axes[EHS].update({1: "text_len"})
        axes.update({name: dict(a) for name, a in self.shared_axes.items()})
        axes[PREDICTION] = dict(axes[LATENT_INPUT])
        return axes

    # ---- decode -----------------------------------------------------------------------

    def decoder_module(self) -> torch.nn.Module:
        return LatentDecoder(self.vae)

    def vae_needs_fp32(self, dtype: torch.dtype) -> bool:
        """Must the VAE decode in fp32 when the model runs in `dtype`? (SDXL's VAE overflows in fp16.)"""
        return False

    # ---- diffusers' own pipeline, on the same modules ----------------------------------

    def pipeline(self, scheduler: Any) -> Any:
        """The diffusers pipeline of this family over the same modules (benchmarks and parity tests)."""
        import diffusers

        cls = getattr(diffusers, self.pipeline_class)
        modules = {k: v for k, v in self.parts.modules.items()}
        pipe = cls(scheduler=scheduler, **modules, **self.pipeline_kwargs())
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_kwargs(self) -> dict:
        return {}

    def pipeline_call_kwargs(self) -> dict:
        """What a call of `pipeline(...)` needs to do what this family's step loop does (text lengths, negatives)."""
        return {}


FLOW_SAMPLERS = ("euler",)  # flow-matching models (SD3, Flux): the Euler ODE step their schedulers define


def flow_match_scheduler(
    config: dict, steps: int, *, sigmas: list[float] | None = None, image_seq_len: int, max_shift: float
) -> Any:
    """FlowMatchEulerDiscreteScheduler from the model's config, timesteps set as its pipeline sets them.

    Where the config asks for resolution-dependent shifting (`use_dynamic_shifting`, Flux-dev,
    SD3.5), `mu` follows the image's token count as in diffusers' pipelines.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", max_shift),
    )
    if scheduler.config.get("use_flow_sigmas"):
        sigmas = None
    scheduler.set_timesteps(steps, sigmas=sigmas, mu=mu if scheduler.config.use_dynamic_shifting else None)
    scheduler.set_begin_index(0)
    return scheduler
