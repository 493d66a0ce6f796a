"""[worker]: the render worker (render/), and what a job may ask of it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from ..accounts import parse_period
from ..text import quote
from ..throttle_params import MAX_BATCH, MAX_INTRA_OP_THREADS, MAX_STEPS
from ..tier_headers import ACCOUNT_HEADER, TIER_HEADER
from ..tiers import TIER_NAMES
from .checks import (
    all_of,
    fraction,
    host_port,
    in_range,
    multiple_of,
    one_of,
    opt,
    per_tier,
    positive,
    torch_device,
    zero_or,
)

# Samplers the worker can build per job (render/engine/samplers.py maps them to diffusers classes).
SAMPLER_NAMES = ("euler_a", "euler", "dpmpp_2m", "ddim", "lcm")
# The embedded test models `worker.model` takes besides a directory (render/engine/tiny/ builds them).
TINY_MODELS = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux")
# UNet/VAE backends (render/engine/backends/select.py builds them; `auto` picks one).
BACKEND_NAMES = ("auto", "torch", "tensorrt")
# What a job may ask of the worker: the HTTP API refuses more, so the per-tier defaults here
# (worker.steps, worker.guidance, worker.size) stay within the same bounds. MAX_STEPS and MAX_BATCH,
# which bound a throttle too, are in turbonode.throttle_params.
MAX_GUIDANCE = 50
MIN_PIXELS = 64
MAX_PIXELS = 2048
# worker.front_nice's default: the front yields where it shares one CPU with its engine (a pinned
# worker of a multi-GPU node). With full collections out of band (worker.gc_out_of_band), 10 took
# such a worker's turbo p99 under its own front's GC storm to 1.14x its idle, against 1.65x at 5
# (docs/worker.md); with more CPUs the two run side by side.
FRONT_NICE_AUTO = -1
SHARED_CPU_NICE = 10
PIXEL_STEP = 8  # SD-family VAEs downsample by 8; a model may need more (the worker checks at start)
MAX_DRAIN_TIMEOUT_S = 3600.0
# worker.weight_port 0: the HTTP port + this (8460 -> 8560, 8461 -> 8561)
WEIGHT_PORT_OFFSET = 100


def guidance_scale(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_GUIDANCE:
        raise ValueError(f"must be a number between 0 and {MAX_GUIDANCE}, got {v!r}")


def address_list(v: Any) -> None:
    """IP addresses or networks (CIDR), as the worker matches a peer against them."""
    for x in v:
        try:
            ipaddress.ip_network(x, strict=False)
        except (TypeError, ValueError):
            raise ValueError(f"expected IP addresses or CIDRs ('10.0.0.5', '10.0.0.0/24'), got {quote(x)}") from None


LEDGER_SCHEMES = ("redis", "rediss", "unix")


def ledger_url(v: Any) -> None:
    scheme, sep, rest = v.partition("://")
    if v != "embedded" and not (sep and scheme in LEDGER_SCHEMES and rest):
        schemes = ", ".join(s + "://" for s in LEDGER_SCHEMES)
        raise ValueError(f"expected 'embedded' or a Redis URL ({schemes}), got {quote(v)}")


def period(v: Any) -> None:
    parse_period(v)


@dataclass
class WorkerConfig:
    listen: str = opt("0.0.0.0:8460", host_port, "HTTP API address")
    control_socket: str = opt("/run/turbonode/worker.sock", help="JSON-RPC control socket path")
    control_group: str = opt("turbonode", help="group owning the control socket (mode 0660)")
    model: str = opt("tiny", help=f"a local diffusers directory, or an embedded test model: {', '.join(TINY_MODELS)}")
    backend: str = opt("auto", one_of(*BACKEND_NAMES), "denoiser/VAE backend")
    device: str = opt("auto", torch_device, "torch device: auto, cpu, cuda, cuda:N")
    torch_graphs: bool = opt(
        True,
        help="the torch backend runs its denoiser and VAE as traced graphs, one per image size: a graph "
        "holds the GIL once per call instead of once per op, so the worker's other threads (GC, HTTP) "
        "do not stall a step",
    )
    max_batch: int = opt(4, in_range(1, MAX_BATCH), "largest denoiser batch (rows: an image with CFG takes two)")
    size: int = opt(
        0,
        zero_or(all_of(in_range(MIN_PIXELS, MAX_PIXELS, " px"), multiple_of(PIXEL_STEP))),
        "default image size in pixels (0: the model's native size)",
    )
    # steps, sampler and guidance: tiers not named take the model family's defaults (docs/worker.md)
    steps: dict[str, int] = opt({}, per_tier(in_range(1, MAX_STEPS)), "default denoising steps per tier")
    queue_limit: dict[str, int] = opt(
        {"turbo": 32, "fast": 64, "other": 64, "relax": 256}, per_tier(positive), "queued jobs per tier before 429"
    )
    min_share: float = opt(0.1, fraction, "minimum share of steps each waiting lower tier gets")
    text_cache_size: int = opt(256, positive, "entries in the text-embedding LRU cache")
    engine_cache_dir: str = opt("/var/cache/turbonode/engines", help="TensorRT engine cache")
    sampler: dict[str, str] = opt({}, per_tier(one_of(*SAMPLER_NAMES)), "diffusers scheduler per tier")
    guidance: dict[str, float] = opt(
        {}, per_tier(guidance_scale), "default guidance per tier (CFG: <= 1 disables it; Flux-dev: embedded)"
    )
    drain_timeout: float = opt(
        30.0,
        in_range(0, MAX_DRAIN_TIMEOUT_S, " s", lo_open=True),
        "seconds SIGTERM waits for in-flight jobs before failing them",
    )
    slo: dict[str, float] = opt(
        {"turbo": 2.0},
        per_tier(positive),
        "request-duration objective per tier (s): exported for alerts; a tier whose oldest queued job has "
        "waited half of it, or whose new job would finish after it, reports not ready",
    )
    refuse_unready: bool = opt(
        False,
        help="answer new work of a tier that is not ready (for a tier with an objective: also a job that "
        "would finish after it) 503 + Retry-After at once (behind a balancer) instead of queueing it",
    )
    capacity: dict[str, float] = opt(
        {},
        per_tier(positive),
        "requests per second of the tier this node sustains within its objective, as bench/capacity.py "
        "measures it: exported with the served rate, for an autoscaler or the fleet alert",
    )
    intra_op_threads: int = opt(
        0,
        in_range(0, MAX_INTRA_OP_THREADS),
        "torch intra-op threads (0: one fewer than the CPUs the worker may use, at least 1)",
    )
    front_nice: int = opt(
        FRONT_NICE_AUTO,
        in_range(FRONT_NICE_AUTO, 19),
        "nice value of the front process's threads once the engine process runs: the engine, and so "
        "turbo's steps, get the CPU first where the two share it (render/front/priority.py). "
        f"{FRONT_NICE_AUTO}: {SHARED_CPU_NICE} where the worker may use one CPU only (front and engine share "
        "it), else 0 (same weight); docs/worker.md has the figures",
    )
    gc_out_of_band: bool = opt(
        True,
        help="where the front yields to its engine (front_nice > 0: by default a worker that may use one CPU), "
        "its full garbage collections run in a thread of their own when no turbo request is in the front "
        "(bounded in time and garbage), not wherever an allocation crosses CPython's threshold "
        "(render/front/full_collections.py); false, or a front that does not yield: CPython's own schedule",
    )
    weight_port: int = opt(
        0,
        in_range(-1, 65535),
        "TCP port answering HAProxy's agent-check with the worker's weight: how much slower its steps run "
        f"than usual (docs/fleet.md, weights). 0: the HTTP port + {WEIGHT_PORT_OFFSET} (ephemeral with an "
        "ephemeral HTTP port; with [workers] tables each one's HTTP port + it); -1: none",
    )
    handshake_tier: str = opt(
        "turbo",
        one_of("", *TIER_NAMES),
        "tier whose DSCP the listening socket carries: handshakes and first packets leave in its class "
        "until a request names its tier ('' = unmarked)",
    )
    keys_file: str = opt(
        "",
        help="API keys, their tiers and budgets (docs/worker.md, accounts); reloaded when it changes. "
        "'' = no keys: any client may ask for any tier",
    )
    trusted_proxies: list[str] = opt(
        [],
        address_list,
        f"addresses or CIDRs (the balancer) whose {TIER_HEADER} and {ACCOUNT_HEADER} headers are obeyed; "
        "from anyone else they are ignored",
    )
    ledger: str = opt(
        "embedded",
        ledger_url,
        "where engine seconds per key are counted: 'embedded' (this node, worker.ledger_file) or a "
        "Redis URL shared by the fleet (redis://HOST:PORT/DB, rediss://..., unix:///PATH)",
    )
    ledger_file: str = opt("/var/lib/turbonode/ledger.sqlite3", help="the embedded ledger's SQLite file")
    budget_period: str = opt(
        "month",
        period,
        "when budgets reset, for keys that name no period: hour, day, week, month (UTC) or a duration ('12h')",
    )
