"""Metric names and labels that more than one part relies on: both daemons, the Grafana
dashboard (deploy/grafana/turbonode.json) and the alerting rules (deploy/prometheus/).

Every series either daemon exports carries NODE_LABEL, the node's name (its hostname unless
the configuration names it), so one dashboard selection shows the agent (:9465) and the
workers (:8460, :8461, ...) of a node although Prometheus scrapes them as separate instances;
a worker's series and the agent's about it carry WORKER_LABEL too.
"""

from __future__ import annotations

NODE_LABEL = "node"
# The worker a series is about, on a node of several ([workers.<name>]): every series of a worker
# carries its name, and so do the agent's per-worker series (its watchers, level and throttle).
WORKER_LABEL = "worker"

# 1 on both daemons; labels: component (agent|worker), version, revision (git), and on the
# worker backend (torch|tensorrt), device and model_family.
BUILD_INFO = "turbonode_build_info"

# The worker's engine process (render/engine/host.py) has prometheus_client's process_* metrics
# under this prefix (turbonode_worker_engine_process_resident_memory_bytes, ..._cpu_seconds_total);
# the unprefixed process_* of the worker are its front's.
ENGINE_PROCESS = "turbonode_worker_engine"
ENGINE_RSS = ENGINE_PROCESS + "_process_resident_memory_bytes"  # the dashboard's daemon panels
ENGINE_CPU = ENGINE_PROCESS + "_process_cpu_seconds_total"

# ---- worker: the tiers' service level, per generation request ------------------------------
# From the request's arrival to its response written, by tier and outcome (OUTCOMES).
REQUEST_DURATION = "turbonode_worker_request_duration_seconds"
# Where that time went, by tier and stage (STAGES), for jobs that reached the stage.
REQUEST_STAGE = "turbonode_worker_request_stage_seconds"
# Generation requests answered, by tier and HTTP status code (counter: _total).
REQUESTS = "turbonode_worker_requests"
# Denoising steps done per image, by tier (counter: rate() is steps per second).
DENOISE_STEPS = "turbonode_worker_denoise_steps"
# 1 while the worker takes new work of the tier (what GET /readyz?tier=T answers), by tier.
READY = "turbonode_worker_ready"
# The configured request-duration objective, by tier: alerts and panels compare p99 with it.
SLO = "turbonode_worker_slo_seconds"

# Headroom, by tier: the requests per second the node sustains within the tier's objective (the
# configured worker.capacity, measured by bench/capacity.py), and those it served over the last
# LOAD_WINDOW_S: what an autoscaler or the fleet alert compares (docs/fleet.md).
CAPACITY = "turbonode_worker_capacity_requests_per_second"
LOAD = "turbonode_worker_load_requests_per_second"
LOAD_WINDOW_S = 60.0

# The weight the worker answers HAProxy's agent-check (render/weight.py: 100 while its steps run at
# their usual pace, down to a few percent when slower) and the step slowdown it comes from.
WEIGHT = "turbonode_worker_weight_percent"
STEP_SLOWDOWN = "turbonode_worker_step_slowdown_ratio"

# ---- agent: its levers ------------------------------------------------------------------------
# What a lever can do on this host, by lever and mode: 1 for the mode in effect, 0 for the others
# it has (io_weight: weight, weight+throttle, throttle or off, agent/levers/io_policy.py): a lever
# the host cannot give is shown, not hidden behind its `turbonode_lever_engaged`.
LEVER_MODE = "turbonode_lever_mode"

STAGES = ("queue_wait", "denoise", "decode", "respond")
# ok: images answered; accepted: an async job queued (202); rejected: 429/503 before queueing
# (queue full, tier shed, not ready, draining); failed: the job failed; cancelled: by the
# client or its disconnect; invalid: a bad request (4xx).
OUTCOMES = ("ok", "accepted", "rejected", "failed", "cancelled", "invalid")
# A request whose tier could not be read (bad body or unknown tier name).
UNKNOWN_TIER = "unknown"
# nginx's code for a client that closed the connection before the answer.
CLIENT_CLOSED = 499

# Sub-second to tens of seconds: a turbo image takes ~0.1-1 s, a relax one up to minutes.
REQUEST_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
