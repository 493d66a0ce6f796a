"""One TOML configuration file (docs/design.md, configuration): every key optional, every bad key named.

Precedence: defaults < file < environment (TURBONODE_<SECTION>_<KEY>) < flags.
Each section is a dataclass; a field's `check` metadata validates its value and raises
ValueError with a message that the loader prefixes with the dotted key.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..accounts import parse_period
from ..cgroups import V2_WEIGHT_MAX, V2_WEIGHT_MIN, parse_cpu_list
from ..errors import ConfigError
from ..levels import ACTION_LEVELS, LEVELS
from ..memory_cgroups import IO_WEIGHT_MAX, IO_WEIGHT_MIN
from ..qos_params import ShareError, check_leaf_limit, check_link_rate, check_percent, check_shares
from ..rates import parse_rate
from ..text import parse_decimal, quote
from ..throttle_params import MAX_BATCH, MAX_INTRA_OP_THREADS, MAX_STEPS, THROTTLE_KEYS, check_throttle, check_ttl
from ..tier_headers import ACCOUNT_HEADER, TIER_HEADER
from ..tiers import TIER_NAMES

# Samplers the worker can build per job (render/samplers.py maps them to diffusers classes).
SAMPLER_NAMES = ("euler_a", "euler", "dpmpp_2m", "ddim", "lcm")
# The embedded test models `worker.model` takes besides a directory (render/tiny/ builds them).
TINY_MODELS = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux")
# UNet/VAE backends (render/backends/select.py builds them; `auto` picks one).
BACKEND_NAMES = ("auto", "torch", "tensorrt")
ENV_PREFIX = "TURBONODE_"
# turboctl's own options read these (`render --url`, `--socket` of the worker commands): they
# share the prefix but are no configuration keys.
CLI_ENV_WORKER_URL = "TURBONODE_WORKER_URL"
CLI_ENV_WORKER_SOCKET = "TURBONODE_WORKER_SOCKET"
CLI_ENV_API_KEY = "TURBONODE_API_KEY"  # `turboctl render --api-key`
CLI_ENV_VARS = (CLI_ENV_WORKER_URL, CLI_ENV_WORKER_SOCKET, CLI_ENV_API_KEY)
T = TypeVar("T")

# What a job may ask of the worker: the HTTP API refuses more, so the per-tier defaults here
# (worker.steps, worker.guidance, worker.size) stay within the same bounds. MAX_STEPS and MAX_BATCH,
# which bound a throttle too, are in turbonode.throttle_params.
MAX_GUIDANCE = 50
MIN_PIXELS = 64
MAX_PIXELS = 2048
PIXEL_STEP = 8  # SD-family VAEs downsample by 8; a model may need more (the worker checks at start)
MAX_DRAIN_TIMEOUT_S = 3600.0
MAX_CPUS = 4096  # a CPU quota in CPUs (levers.best_effort_cpus); CPUs are numbered below it
MAX_GPUS = 1024  # NVML indexes are below it ([workers.<name>] gpu)
# The one worker of a node whose file names none ([workers] absent): [worker] and agent.worker_socket.
DEFAULT_WORKER = "default"
# worker.weight_port 0: the HTTP port + this (8460 -> 8560, 8461 -> 8561)
WEIGHT_PORT_OFFSET = 100
# A worker's name is a systemd instance (turbonode-worker@<name>), part of a file name and a
# metric label value: letters, digits, '-' and '_'.
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
# The agent's sampling period: below 50 ms the sampler costs more CPU than it saves; above a
# minute it reacts to nothing (and time arithmetic overflows long before 1e300).
SAMPLE_PERIOD_RANGE_S = (0.05, 60.0)
MAX_MIN_CHANGE_INTERVAL_S = 3600.0  # policy.min_change_interval: beyond an hour the policy is frozen
MAX_DWELL_S = 3600.0  # a rule's enter_s / exit_s: beyond an hour it never acts
MAX_WRITE_LIMIT = 2**53  # levers.best_effort_write_bps / _iops (the kernel takes u64; TOML ints are exact to here)
# io_throttle's caps (docs/benchmarks.md, node SLO io cell)
BEST_EFFORT_WRITE_BPS = 32 << 20
BEST_EFFORT_WRITE_IOPS = 256
PSI_WINDOW_US = 1_000_000  # the PSI trigger window (agent/watchers/psi.py): a threshold fits in it
MEMORY_EXIT_S = 30.0  # the memory rules' dwell below exit before their levers are released


# ---- checks (raise ValueError with a message; the loader names the key) -------------

Check = Callable[[Any], object]  # raises ValueError; what it returns is ignored


def positive(v: Any) -> None:
    if v <= 0:
        raise ValueError(f"must be positive, got {v}")


def in_range(lo: float, hi: float, unit: str = "", lo_open: bool = False) -> Check:
    """lo <= v <= hi (lo < v with lo_open); the message shows the range."""

    def check(v: Any) -> None:
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            span = f"more than {_num(lo)} and at most {_num(hi)}" if lo_open else f"between {_num(lo)} and {_num(hi)}"
            raise ValueError(f"must be {span}{unit}, got {_num(v)}")

    return check


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) and not x.is_integer() or abs(x) >= 1e16 else str(int(x))


def all_of(*checks: Check) -> Check:
    def check(v: Any) -> None:
        for c in checks:
            c(v)

    return check


def multiple_of(step: int) -> Check:
    def check(v: Any) -> None:
        if v % step:
            raise ValueError(f"must be a multiple of {step}, got {v}")

    return check


def link_rate(v: Any) -> None:
    check_link_rate(parse_rate(v))  # RateError is a ValueError


def zero_or(inner: Check) -> Check:
    """0 (a default that means "the model's own"), or a value `inner` accepts."""

    def check(v: Any) -> None:
        if v != 0:
            inner(v)

    return check


def empty_or(inner: Check) -> Check:
    """'' (a default that is derived from other keys), or a value `inner` accepts."""

    def check(v: Any) -> None:
        if v != "":
            inner(v)

    return check


def cpu_list(v: Any) -> None:
    parse_cpu_list(v, MAX_CPUS)


def fraction(v: Any) -> None:
    if not 0 <= v <= 1:
        raise ValueError(f"must be between 0 and 1, got {v}")


def guidance_scale(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_GUIDANCE:
        raise ValueError(f"must be a number between 0 and {MAX_GUIDANCE}, got {v!r}")


def one_of(*choices: object) -> Check:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {v!r}")

    return check


def torch_device(v: Any) -> None:
    """auto, cpu, cuda or cuda:N: the devices the worker's backends run on (render/backends)."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", v):
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {quote(v)}")


def host_port(v: Any) -> None:
    host, sep, port = v.rpartition(":")
    number = parse_decimal(port)
    if not sep or number is None or not 0 <= number < 65536:
        raise ValueError(f"expected HOST:PORT, got {quote(v)}")


def split_host_port(address: str) -> tuple[str, int]:
    """'HOST:PORT' (validated by host_port) -> (host, port); '[::1]:80' -> ('::1', 80); no host = all."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def per_tier(inner: Check | None = None) -> Check:
    """A table keyed by tier name; every value checked with `inner`."""

    def check(v: Any) -> None:
        for k, x in v.items():
            if k not in TIER_NAMES:
                raise ValueError(f"unknown tier {k!r} (expected one of {', '.join(TIER_NAMES)})")
            if inner:
                try:
                    inner(x)
                except ValueError as exc:
                    raise ValueError(f"{k}: {exc}") from None

    return check


def dscp_table(v: Any) -> None:
    for k, name in v.items():
        dscp = parse_decimal(k)
        if dscp is None or not 0 <= dscp < 64:
            raise ValueError(f"DSCP key {quote(k)} must be an integer 0..63")
        if name not in TIER_NAMES:
            raise ValueError(f"DSCP {k} maps to unknown tier {quote(name)}")


def opt(default: Any, check: Check | None = None, help: str = "", table_help: Mapping[str, str] | None = None) -> Any:
    """A config field: default, optional check, one-line help (a comment in `config example`;
    `table_help` comments each sub-table of a table of tables)."""
    factory = (lambda d=default: copy.deepcopy(d)) if isinstance(default, (dict, list)) else None
    meta = {"check": check, "help": help, "table_help": table_help or {}}
    if factory:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---- sections ------------------------------------------------------------------------


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
class NodeConfig:
    name: str = opt("", help="the node's name: the `node` label of every metric both daemons export ('' = hostname)")


@dataclass
class QosConfig:
    dev: str = opt("", help="egress interface to shape")
    netns: str = opt("", help="named network namespace of dev ('' = the agent's own)")
    rate: str = opt("1gbit", link_rate, "link rate the HTB root shapes to")
    leaf_limit: int = opt(1000, check_leaf_limit, "packets each leaf queue holds")
    dscp: dict[str, str] = opt({}, dscp_table, "DSCP -> tier overrides on top of the default table")
    rate_pct: dict[str, int] = opt({}, per_tier(check_percent), "guaranteed share per tier, percent of rate")
    ceil_pct: dict[str, int] = opt({}, per_tier(check_percent), "ceiling per tier, percent of rate")
    keep_on_stop: bool = opt(True, help="leave the datapath in place when the agent stops (fail-static)")


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


@dataclass
class AgentConfig:
    worker_socket: str = opt(
        "/run/turbonode/worker.sock",
        help="control socket of the worker to throttle, on a node without [workers] tables (each names its own)",
    )
    socket: str = opt("/run/turbonode/agent.sock", help="the agent's own status socket")
    metrics: str = opt("0.0.0.0:9465", host_port, "Prometheus metrics address")
    sample_period: float = opt(
        0.1,
        in_range(*SAMPLE_PERIOD_RANGE_S, " s"),
        "seconds between samples (sources that push are sampled at once too)",
    )
    throttle_ttl: float = opt(3.0, check_ttl, "seconds a throttle lasts unless renewed")
    procfs: str = opt("/proc", help="procfs root (host /proc in a container)")
    sysfs: str = opt("/sys", help="sysfs root")
    dry_run: bool = opt(False, help="log what the policy would do; change nothing")


@dataclass
class WorkerEntry:
    """One worker of a multi-GPU node, `[workers.<name>]`: its name is its systemd instance
    (turbonode-worker@<name>), its `worker` metric label and turboctl's `--worker NAME`; every
    other [worker] key is shared by all of them. '' derives the value from the name (node_workers)."""

    control_socket: str = opt("", help="its control socket ('': worker.control_socket with -<name> before .sock)")
    listen: str = opt(
        "",
        empty_or(host_port),
        "its HTTP API ('': worker.listen's host and its port plus the worker's position among the tables)",
    )
    weight_port: int = opt(
        0,
        in_range(0, 65535),
        "its agent-check port (0: worker.weight_port plus the worker's position, or its HTTP port + "
        f"{WEIGHT_PORT_OFFSET} when worker.weight_port is 0)",
    )
    gpu: int = opt(
        -1,
        in_range(-1, MAX_GPUS - 1),
        "NVML index of its GPU (nvidia-smi's order; -1: none): the agent watches that GPU for it",
    )
    device: str = opt("", empty_or(torch_device), "its torch device ('': cuda:<gpu>, or worker.device without a gpu)")
    cgroup: str = opt(
        "auto",
        help="its cgroup, which cpu_share favours: 'auto' (its own, found from its pid), a path or systemd "
        "slice, '' (leave it alone)",
    )
    cpus: str = opt(
        "",
        empty_or(cpu_list),
        "the CPUs it runs on, e.g. '0-3' ('': any); its intra-op threads are sized to them",
    )


# The levers a rule may engage while it is active (agent/levers/): `cpu_share` favours the
# worker's cgroup over best-effort cgroups (CPU weight, optional quota); `worker_threads` lowers
# the worker's torch intra-op threads through its throttle; `memory_squeeze` holds the best-effort
# memory cgroups where they are, `memory_protect` keeps the worker's from reclaim (v2), `io_weight`
# favours the worker's io cgroup, `io_throttle` caps the best-effort cgroups' writes
# (agent/levers/memory.py, io.py). docs/agent.md, measured in docs/benchmarks.md.
LEVER_NAMES = ("cpu_share", "worker_threads", "memory_squeeze", "memory_protect", "io_weight", "io_throttle")
OOM_SCORE_ADJ = (-1000, 1000)  # /proc/PID/oom_score_adj's range


@dataclass(frozen=True)
class RuleDefaults:
    """A policy rule's default thresholds, the check its values pass, what its signal is, the
    levers it engages while active, and the highest level it may raise the node to."""

    enter: float
    exit: float
    check: Check
    help: str
    levers: tuple[str, ...] = ()
    max_level: str = ACTION_LEVELS[-1]
    exit_s: float | None = None  # its own dwell below exit (None: policy.exit_s)


# The policy's rules, one per signal a watcher publishes (docs/agent.md): above `enter` for
# enter_s seconds a rule is active, below `exit` for exit_s seconds it is healthy again
# (hysteresis; each rule's dwell defaults to policy.enter_s / policy.exit_s).
# A rule whose cause is treated raises the level only to `pressured`: the lever rules (the
# worker's CPU share and threads) and GC pauses, which the worker's traced graphs ride out
# (worker.torch_graphs). Throttling lower tiers further is left to the effect on turbo
# (turbo_wait_s), so that lower tiers keep making progress while turbo is protected
# (docs/benchmarks.md, node SLO).
# Adding a rule is one entry here: the config, its example and the agent's policy follow.
POLICY_RULES: dict[str, RuleDefaults] = {
    # contention, not the worker's own compute (agent/watchers/cpu.py): the node SLO's idle cell
    # read p50/p90 0.01/0.05, a hog on every CPU 0.54/0.82 with the levers engaged
    # (docs/benchmarks.md, "cpu_load as contention")
    "cpu_load": RuleDefaults(
        0.35,
        0.25,
        fraction,
        "CPU busy fraction taken by others than the worker (incl. softirq, steal)",
        ("cpu_share", "worker_threads"),
        "pressured",
    ),
    "gc_pause_s": RuleDefaults(0.005, 0.001, positive, "longest new worker GC pause (s)", (), "pressured"),
    "netrx_latency_p99_s": RuleDefaults(
        200e-6, 50e-6, positive, "NET_RX softirq raise-to-run p99 (s)", ("cpu_share",), "pressured"
    ),
    "netrx_cpu_share": RuleDefaults(
        0.25, 0.10, fraction, "busiest CPU's share of time in the NET_RX softirq", ("cpu_share",), "pressured"
    ),
    "turbo_wait_s": RuleDefaults(0.5, 0.25, positive, "oldest queued turbo job's wait (s)"),
    # memory and io (agent/watchers/psi.py, memory.py; docs/benchmarks.md, node SLO memory cells).
    # Their levers treat the cause (the worker's pages kept, the job held), the level's throttle does
    # not (a smaller batch takes no page from the job): levers only. Released 3 s after the stall, the
    # lock let the job's next push evict the worker again (seen in the node SLO memory cells'
    # logs, docs/benchmarks.md): they hold for 30 s of calm (memory cell 13.12x -> 0.87x the idle p99), and
    # best_effort_memory_held keeps them while the held job pushes.
    "psi_memory_some": RuleDefaults(
        0.10,
        0.02,
        fraction,
        "the node's memory stall fraction (PSI some)",
        ("memory_squeeze", "memory_protect"),
        "normal",
        MEMORY_EXIT_S,
    ),
    # the worker's own cgroup's stall (v2 only; None elsewhere: healthy): the node's thresholds, the
    # worker's stall being the part of the node's that matters (not measured: no v2 memory here)
    "worker_psi_memory_some": RuleDefaults(
        0.10,
        0.02,
        fraction,
        "the worker's memory cgroup's stall fraction (PSI some; cgroup v2)",
        ("memory_squeeze", "memory_protect"),
        "normal",
        MEMORY_EXIT_S,
    ),
    "worker_major_faults_per_s": RuleDefaults(
        50.0,
        5.0,
        positive,
        "the worker's major page faults per second (its code and files read back)",
        ("memory_squeeze", "memory_protect"),
        "normal",
        MEMORY_EXIT_S,
    ),
    # the squeeze holds while the job pushes against it, after the stall it caused has gone; it only
    # keeps the levers engaged (max_level normal: nothing to throttle in the worker for it)
    "best_effort_memory_held": RuleDefaults(
        0.5,
        0.5,
        fraction,
        "1 while a best-effort cgroup pushes against the limit memory_squeeze set, else 0",
        ("memory_squeeze", "memory_protect"),
        "normal",
    ),
    # io: the worker reads and writes nothing while it serves; a stalled writer's own waits are the
    # node's io stall (PSI some), so throttling the worker's lower tiers for it helps nobody: the
    # rule weighs and caps the best-effort cgroups' io (max_level normal)
    "psi_io_some": RuleDefaults(
        0.30, 0.10, fraction, "the node's io stall fraction (PSI some)", ("io_weight", "io_throttle"), "normal"
    ),
}
POLICY_SIGNALS = tuple(POLICY_RULES)
RULE_KEYS = ("enter", "exit", "enter_s", "exit_s", "levers", "max_level")
check_dwell = in_range(0, MAX_DWELL_S, " s")  # enter_s / exit_s, the policy's and each rule's


def policy_signals(v: Any) -> None:
    for name in v:
        if name not in POLICY_SIGNALS:
            raise ValueError(f"unknown signal {name!r} (known: {', '.join(POLICY_SIGNALS)})")


def merged_rules(rules: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rule's table: the file's keys over the defaults, key by key (naming only `enter`
    keeps the default `exit`)."""
    return {
        signal: {
            "enter": d.enter,
            "exit": d.exit,
            "levers": list(d.levers),
            "max_level": d.max_level,
            **({"exit_s": d.exit_s} if d.exit_s is not None else {}),
            **rules.get(signal, {}),
        }
        for signal, d in POLICY_RULES.items()
    }


def policy_rules(v: Any) -> None:
    """[policy.rules.<signal>]: enter and exit thresholds (exit <= enter), optional own dwell
    (seconds), levers, highest level."""
    for signal, table in v.items():
        if signal not in POLICY_RULES:
            raise ValueError(f"unknown signal {signal!r} (known: {', '.join(POLICY_SIGNALS)})")
        if not isinstance(table, dict):
            raise ValueError(f"{signal}: expected a table, got {table!r}")
        for k, x in table.items():
            where = f"{signal}.{k}"
            if k not in RULE_KEYS:
                raise ValueError(f"{where}: unknown key (known: {', '.join(RULE_KEYS)})")
            if k == "levers":
                if not isinstance(x, list) or any(lever not in LEVER_NAMES for lever in x):
                    raise ValueError(f"{where}: expected a list of levers from {', '.join(LEVER_NAMES)}, got {x!r}")
                continue
            if k == "max_level":  # normal: a rule that only engages its levers
                if x not in LEVELS:
                    raise ValueError(f"{where}: expected one of {', '.join(LEVELS)}, got {x!r}")
                continue
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"{where}: expected a number, got {x!r}")
            try:
                (POLICY_RULES[signal].check if k in ("enter", "exit") else check_dwell)(x)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
    for signal, table in merged_rules(v).items():
        if table["exit"] > table["enter"]:
            raise ValueError(f"{signal}.exit: must not exceed {signal}.enter ({table['enter']}), got {table['exit']}")


ACTION_KEYS = ("relax_ceil_pct", *THROTTLE_KEYS)


def level_actions(v: Any) -> None:
    """Per degradation level, what the agent does: the relax ceil and the worker's throttle, whose
    limits are checked as the worker checks them (turbonode.throttle_params)."""
    for level, acts in v.items():
        if level not in ACTION_LEVELS:
            raise ValueError(f"unknown level {level!r} (expected one of {', '.join(ACTION_LEVELS)})")
        if not isinstance(acts, dict):
            raise ValueError(f"{level}: expected a table, got {acts!r}")
        for k in acts:
            if k not in ACTION_KEYS:
                raise ValueError(f"{level}.{k}: unknown action (known: {', '.join(ACTION_KEYS)})")
        ceil = acts.get("relax_ceil_pct")
        if ceil is not None:
            try:
                check_percent(ceil)
            except ValueError as exc:
                raise ValueError(f"{level}.relax_ceil_pct: {exc}") from None
        try:
            check_throttle(**{k: x for k, x in acts.items() if k in THROTTLE_KEYS})
        except ValueError as exc:
            raise ValueError(f"{level}.{exc}") from None


@dataclass
class PolicyConfig:
    enter_s: float = opt(0.3, check_dwell, "seconds above a rule's enter threshold before escalating (rules' default)")
    exit_s: float = opt(
        3.0, check_dwell, "seconds below a rule's exit threshold before it is healthy again (rules' default)"
    )
    min_change_interval: float = opt(
        1.0, in_range(0, MAX_MIN_CHANGE_INTERVAL_S, " s", lo_open=True), "seconds between two level changes"
    )
    disabled: list[str] = opt([], policy_signals, "signals the policy ignores (still watched and shown)")
    psi_trigger_us: int = opt(
        100000,
        in_range(1, PSI_WINDOW_US, " us"),
        "PSI trigger: stall microseconds per second of its window that wake the sampler at once",
    )
    rules: dict[str, dict[str, Any]] = opt(
        merged_rules({}),
        policy_rules,
        "per signal: enter and exit thresholds; enter_s/exit_s override the dwell; levers it engages while "
        "active; max_level, the highest level it raises the node to (normal: it only engages its levers)",
        table_help={signal: d.help for signal, d in POLICY_RULES.items()},
    )
    actions: dict[str, dict[str, Any]] = opt(
        {
            "pressured": {"relax_ceil_pct": 50, "max_batch": 2},
            "degraded": {"relax_ceil_pct": 25, "max_batch": 2, "paused_tiers": ["relax"], "step_caps": {"fast": 8}},
            "critical": {
                "relax_ceil_pct": 10,
                "max_batch": 1,
                "paused_tiers": ["relax"],
                "step_caps": {"fast": 6},
                "shed_tiers": ["relax"],
                "unready_tiers": ["turbo"],
            },
        },
        level_actions,
        "what each level does (relax_ceil_pct, max_batch, paused_tiers, step_caps, shed_tiers, unready_tiers)",
    )

    def __post_init__(self) -> None:
        self.rules = merged_rules(self.rules)


def string_list(v: Any) -> None:
    if not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"expected an array of non-empty strings, got {v!r}")


def device_list(v: Any) -> None:
    """Block devices: "MAJ:MIN", a name or a /dev path each (turbonode/block_devices.py resolves them)."""
    string_list(v)
    for x in v:
        if not re.fullmatch(r"\d+:\d+|(/dev/)?[\w.+-]+(/[\w.+-]+)*", x):
            raise ValueError(f"expected a block device as 'MAJ:MIN', a name or a /dev path, got {x!r}")


CPU_WEIGHT = in_range(V2_WEIGHT_MIN, V2_WEIGHT_MAX)  # cgroup v2 cpu.weight units (turbonode/cgroups.py)


@dataclass
class LeversConfig:
    state_file: str = opt(
        "", help="what the levers changed, put back at the next start after a crash ('': beside agent.socket)"
    )
    cgroup_root: str = opt("/sys/fs/cgroup", help="cgroup filesystem root (the host's, in a container)")
    worker_cgroup: str = opt(
        "auto",
        help="the worker's cgroup that cpu_share and io_weight favour, on a node without [workers] tables (each "
        "names its own): 'auto' (the worker's own, found from its pid), a path or systemd slice, '' (leave it alone)",
    )
    best_effort_cgroups: list[str] = opt(
        [], string_list, "cgroups or systemd slices of co-located batch work that cpu_share holds back"
    )
    worker_cpu_weight: int = opt(10000, CPU_WEIGHT, "cpu.weight (v2 units) of every worker's cgroup while engaged")
    best_effort_cpu_weight: int = opt(1, CPU_WEIGHT, "cpu.weight (v2 units) of each best-effort cgroup while engaged")
    best_effort_cpus: float = opt(
        0.0, in_range(0, MAX_CPUS), "CPU cap of each best-effort cgroup while engaged (0: none)"
    )
    quota_neighbour_share: float = opt(
        0.1,
        in_range(0, 1),
        "while cpu_share is engaged, cap each cgroup that shares a worker's CPU quota (its nearest ancestor's) "
        "at this share of that quota (0: leave them)",
    )
    worker_threads: int = opt(
        1, in_range(1, MAX_INTRA_OP_THREADS), "torch intra-op threads of the worker while worker_threads is engaged"
    )
    memory_worker_cgroup: str = opt(
        "auto",
        help="the workers' memory cgroup that memory_protect protects: 'auto' (each worker's own), a path or slice, ''",
    )
    memory_best_effort_cgroups: list[str] = opt(
        [],
        string_list,
        "memory cgroups of batch work that memory_squeeze holds and oom_guard offers the OOM killer "
        "([]: levers.best_effort_cgroups)",
    )
    oom_guard: bool = opt(
        True, help="while the agent runs: the worker's and its own oom_score_adj lowered, best-effort processes' raised"
    )
    worker_oom_score_adj: int = opt(-900, in_range(*OOM_SCORE_ADJ), "oom_score_adj of the worker and the agent")
    best_effort_oom_score_adj: int = opt(
        1000, in_range(*OOM_SCORE_ADJ), "oom_score_adj of the processes in the best-effort cgroups"
    )
    worker_io_weight: int = opt(
        1000, in_range(IO_WEIGHT_MIN, IO_WEIGHT_MAX), "io.weight (v2 units) of every worker's cgroup while engaged"
    )
    best_effort_io_weight: int = opt(
        1, in_range(IO_WEIGHT_MIN, IO_WEIGHT_MAX), "io.weight (v2 units) of each best-effort cgroup while engaged"
    )
    best_effort_write_bps: int = opt(
        BEST_EFFORT_WRITE_BPS,
        in_range(0, MAX_WRITE_LIMIT),
        "while io_throttle is engaged, each best-effort cgroup's writes per device in bytes/s (0: no byte cap)",
    )
    best_effort_write_iops: int = opt(
        BEST_EFFORT_WRITE_IOPS,
        in_range(0, MAX_WRITE_LIMIT),
        "while io_throttle is engaged, each best-effort cgroup's write requests per device a second (0: no cap)",
    )
    io_throttle_devices: list[str] = opt(
        [],
        device_list,
        "the disks io_throttle caps writes to: 'MAJ:MIN', names or /dev paths ([]: every disk a mounted "
        "filesystem lies on)",
    )


@dataclass
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    qos: QosConfig = field(default_factory=QosConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    levers: LeversConfig = field(default_factory=LeversConfig)
    workers: dict[str, WorkerEntry] = field(
        default_factory=dict,
        metadata={
            "help": "the node's workers, one table each (none: one worker, named default, as [worker] and "
            "agent.worker_socket say)"
        },
    )


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of the node with every '' of its table resolved: what the agent watches and
    throttles, and what `turboctl worker run --instance NAME` serves."""

    name: str
    control_socket: str
    listen: str
    gpus: tuple[int, ...] | None  # NVML indexes it renders on; None: every GPU (a node naming no workers)
    device: str
    cgroup: str  # levers.worker_cgroup's forms
    cpus: frozenset[int]  # empty: any
    weight_port: int = 0  # worker.weight_port's forms


def instance_socket(base: str, name: str) -> str:
    """/run/turbonode/worker.sock -> /run/turbonode/worker-<name>.sock"""
    root, ext = os.path.splitext(base)
    return f"{root}-{name}{ext}"


def node_workers(cfg: Config) -> list[WorkerSpec]:
    """The node's workers, in the file's order; without [workers] tables the single `default` one
    (agent.worker_socket, worker.listen, worker.device, levers.worker_cgroup, every GPU)."""
    w = cfg.worker
    if not cfg.workers:
        return [
            WorkerSpec(
                DEFAULT_WORKER,
                cfg.agent.worker_socket,
                w.listen,
                None,
                w.device,
                cfg.levers.worker_cgroup,
                frozenset(),
                w.weight_port,
            )
        ]
    host, _, port = w.listen.rpartition(":")
    return [
        WorkerSpec(
            name,
            e.control_socket or instance_socket(w.control_socket, name),
            e.listen or f"{host}:{int(port) + i}",
            () if e.gpu < 0 else (e.gpu,),
            e.device or (f"cuda:{e.gpu}" if e.gpu >= 0 else w.device),
            e.cgroup,
            parse_cpu_list(e.cpus) if e.cpus else frozenset(),
            e.weight_port or (w.weight_port + i if w.weight_port > 0 else w.weight_port),
        )
        for i, (name, e) in enumerate(cfg.workers.items())
    ]


def instance_worker(cfg: Config, name: str | None) -> tuple[WorkerConfig, WorkerSpec]:
    """What worker `name` runs: [worker] with its socket, address and device (None: the node's only
    worker, which must then be unnamed). A name the file does not define is a ConfigError."""
    specs = {s.name: s for s in node_workers(cfg)}
    if name is None and cfg.workers:
        raise ConfigError("workers", f"this node names its workers ({', '.join(specs)}): name one")
    spec = specs.get(name or DEFAULT_WORKER)
    if spec is None:
        raise ConfigError(f"workers.{name}", f"no such worker (this node's: {', '.join(specs)})")
    if not cfg.workers:  # the node's only worker is [worker] as it is
        return cfg.worker, dataclasses.replace(spec, control_socket=cfg.worker.control_socket)
    return dataclasses.replace(
        cfg.worker,
        control_socket=spec.control_socket,
        listen=spec.listen,
        device=spec.device,
        weight_port=spec.weight_port,
    ), spec


def weight_address(listen: str, weight_port: int) -> tuple[str, int] | None:
    """Where a worker on `listen` answers HAProxy's agent-check (worker.weight_port's forms): None
    for -1; 0 is the HTTP port + WEIGHT_PORT_OFFSET, or 0 (ephemeral) with an ephemeral HTTP port."""
    if weight_port < 0:
        return None
    host, port = split_host_port(listen)
    if weight_port == 0:
        weight_port = port + WEIGHT_PORT_OFFSET if port else 0
    return host, weight_port


# ---- loading -------------------------------------------------------------------------

_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "table", list: "array"}


def _typed(key: str, hint: Any, value: Any, where: str = "") -> Any:
    """`value` checked against the field's type hint, element by element inside tables and arrays
    (`where` is the path inside the field); an integer widens to a float."""
    origin = typing.get_origin(hint) or hint
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if origin is not Any and (origin is int and isinstance(value, bool) or not isinstance(value, origin)):
        at = f"{where}: " if where else ""
        raise ConfigError(key, f"{at}expected {_TYPE_NAMES.get(origin, origin.__name__)}, got {quote(value)}")
    args = typing.get_args(hint) or (Any,)
    if isinstance(value, dict):
        return {k: _typed(key, args[-1], v, f"{where}.{k}" if where else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(key, args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _finite(key: str, value: Any, where: str = "") -> None:
    """No float anywhere may be nan or infinite: TOML spells both, and no setting means either.
    (Runs after the field's own check, whose message names the range where it has one.)"""
    if isinstance(value, float) and not math.isfinite(value):
        at = f"{where}: " if where else ""
        raise ConfigError(key, f"{at}must be a finite number, got {value}")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        _finite(key, v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else k)


def _build(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip("."), f"expected a table, got {quote(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # a config dataclass
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        if name not in fields:
            raise ConfigError(key, f"unknown key (known: {', '.join(fields)})")
        typ = hints[name]
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value, key + ".")
            continue
        table = table_of(typ)
        if table is not None:
            kwargs[name] = _build_tables(table, value, key)
            continue
        value = _typed(key, typ, value)
        check = fields[name].metadata.get("check")
        if check:
            try:
                check(value)
            except ValueError as exc:
                raise ConfigError(key, str(exc)) from None
        _finite(key, value)
        kwargs[name] = value
    return cls(**kwargs)


def table_of(hint: Any) -> type | None:
    """The section class of a `dict[str, <section>]` field (one table per name: [workers.<name>])."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict and len(args) == 2 and isinstance(args[1], type):
        return args[1] if dataclasses.is_dataclass(args[1]) else None
    return None


def _build_tables(cls: type[T], data: Any, key: str) -> dict[str, T]:
    if not isinstance(data, Mapping):
        raise ConfigError(key, f"expected a table of tables ([{key}.<name>]), got {quote(data)}")
    out = {}
    for name, table in data.items():
        if not WORKER_NAME.fullmatch(name):
            raise ConfigError(
                f"{key}.{name}", "a name is 1-32 letters, digits, '-' or '_', starting with a letter or digit"
            )
        out[name] = _build(cls, table, f"{key}.{name}.")
    return out


def _check_workers(cfg: Config) -> None:
    """Workers that could not all run on one node: a shared socket, port or CPU; a key that names
    the single worker of a node that names several."""
    if not cfg.workers:
        return
    defaults = Config()
    for key, value, default in (
        ("agent.worker_socket", cfg.agent.worker_socket, defaults.agent.worker_socket),
        ("levers.worker_cgroup", cfg.levers.worker_cgroup, defaults.levers.worker_cgroup),
    ):
        if value != default:
            raise ConfigError(
                key, "names the single worker of a node without [workers]: set it in each [workers.<name>] table"
            )
    specs = node_workers(cfg)
    for i, spec in enumerate(specs):
        where = f"workers.{spec.name}"
        if not 0 < split_host_port(spec.listen)[1] < 65536:
            raise ConfigError(f"{where}.listen", f"port {spec.listen.rpartition(':')[2]} is out of range: set listen")
        for other in specs[:i]:
            if os.path.abspath(other.control_socket) == os.path.abspath(spec.control_socket):
                raise ConfigError(f"{where}.control_socket", f"{spec.control_socket} is workers.{other.name}'s too")
            if _same_port(spec.listen, other.listen):
                raise ConfigError(f"{where}.listen", f"{spec.listen} is workers.{other.name}'s too ({other.listen})")
            if spec.cpus & other.cpus:
                cpus = ",".join(map(str, sorted(spec.cpus & other.cpus)))
                raise ConfigError(f"{where}.cpus", f"CPUs {cpus} are workers.{other.name}'s too: each gets its own")


def _same_port(a: str, b: str) -> bool:
    """Two HOST:PORT addresses that cannot both be bound: one port, the same host or a wildcard."""
    (ha, pa), (hb, pb) = split_host_port(a), split_host_port(b)
    return pa == pb and (ha == hb or {"0.0.0.0", "::"} & {ha, hb} != set())


def _check_across(cfg: Config) -> None:
    """What no single key can check: values that must fit together."""
    try:
        check_shares(cfg.qos.rate_pct, cfg.qos.ceil_pct)
    except ShareError as exc:
        raise ConfigError(f"qos.{exc.field}", exc.message) from None
    a = cfg.agent
    if a.throttle_ttl < 2 * a.sample_period:  # renewed at a sample: one late sample must not let it lapse
        raise ConfigError(
            "agent.throttle_ttl",
            f"must be at least twice agent.sample_period ({a.sample_period:g} s), got {a.throttle_ttl:g}",
        )
    _check_workers(cfg)
    _check_weight_ports(cfg)


def _check_weight_ports(cfg: Config) -> None:
    """Each worker's agent-check port in range and its own: no worker's HTTP port, no other's."""
    specs = node_workers(cfg)
    for i, spec in enumerate(specs):
        own = cfg.workers.get(spec.name)
        key = f"workers.{spec.name}.weight_port" if own is not None and own.weight_port else "worker.weight_port"
        address = weight_address(spec.listen, spec.weight_port)
        if address is None:
            continue
        host, port = address
        if port > 65535:
            raise ConfigError(key, f"port {port} (for the worker on {spec.listen}) is out of range: set {key}")
        if not port:
            continue
        taken = [(s.listen, f"{s.name}'s HTTP port") for s in specs] + [
            (f"{a[0]}:{a[1]}", f"{s.name}'s weight port")
            for s in specs[:i]
            if (a := weight_address(s.listen, s.weight_port)) is not None
        ]
        for other, what in taken:
            if _same_port(f"{host}:{port}", other):
                raise ConfigError(key, f"port {port} (for the worker on {spec.listen}) is worker {what} too")


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for dotted, value in extra.items():
        node: Any = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(dotted, "cannot override inside a non-table value")
        node[leaf] = value
    return out


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    sections = typing.get_type_hints(Config)
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in CLI_ENV_VARS:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        if section not in sections or not key:
            continue
        if table_of(sections[section]) is not None:
            raise ConfigError(name, f"[{section}.<name>] tables are set in the configuration file, not the environment")
        known = [f.name for f in dataclasses.fields(sections[section])]
        if key not in known:
            raise ConfigError(name, f"names no configuration key: {section}.{key} (known: {', '.join(known)})")
        try:  # a TOML literal when it parses as one (numbers, booleans, tables), else a string
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        except RecursionError:
            raise ConfigError(name, "nested too deeply") from None
        out[f"{section}.{key}"] = value
    return out


def build_config(
    data: dict[str, Any], source: str | None, env: Mapping[str, str], overrides: Mapping[str, Any] | None
) -> Config:
    """The file's tables (`data`, read from `source`; None: no file) with the environment's and
    the flags' values over them, built and validated."""
    data = _merge(data, _env_overrides(env))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        cfg = _build(Config, data, "")
    except RecursionError:  # a value nested deep enough to pass tomllib but not the checks
        raise ConfigError(source or "environment", "a value is nested too deeply") from None
    _check_across(cfg)
    return cfg


def as_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
