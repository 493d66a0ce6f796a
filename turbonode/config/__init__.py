"""One TOML configuration file (docs/design.md, configuration): every key optional, every bad key named.

Precedence: defaults < file < environment (TURBONODE_<SECTION>_<KEY>) < flags.
One module per section (node, qos, worker, agent, policy, levers, workers), the check library
(checks), the policy's rules (rules), the node's workers (topology), Config (file) and the rest of
loading (loader). Where the file is and load_config are here: the CLI reads them from the package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..toml_file import read_toml
from .agent import AgentConfig
from .checks import split_host_port
from .file import Config
from .levers import LeversConfig
from .loader import build_config
from .policy import PolicyConfig
from .qos import QosConfig
from .rules import MEMORY_EXIT_S, POLICY_RULES
from .topology import DEFAULT_WORKER, WorkerSpec, instance_worker, node_workers, weight_address
from .worker import (
    BACKEND_NAMES,
    MAX_GUIDANCE,
    MAX_PIXELS,
    MIN_PIXELS,
    SAMPLER_NAMES,
    TINY_MODELS,
    WEIGHT_PORT_OFFSET,
    WorkerConfig,
)

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_PATH",
    "DEFAULT_WORKER",
    "MAX_GUIDANCE",
    "MAX_PIXELS",
    "MEMORY_EXIT_S",
    "MIN_PIXELS",
    "POLICY_RULES",
    "SAMPLER_NAMES",
    "TINY_MODELS",
    "WEIGHT_PORT_OFFSET",
    "AgentConfig",
    "Config",
    "ConfigError",
    "LeversConfig",
    "PolicyConfig",
    "QosConfig",
    "WorkerConfig",
    "WorkerSpec",
    "config_path",
    "instance_worker",
    "load_config",
    "node_workers",
    "split_host_port",
    "weight_address",
]

DEFAULT_PATH = "/etc/turbonode/turbonode.toml"


def config_path(path: str | None) -> str | None:
    """The file load_config reads: `path`, else DEFAULT_PATH if it exists, else None (defaults)."""
    if path is not None:
        return path
    return DEFAULT_PATH if os.path.lexists(DEFAULT_PATH) else None


def load_config(
    path: str | None = None, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Load and validate. `path=None` reads DEFAULT_PATH if it exists; an explicit path must exist."""
    source = config_path(path)
    data = read_toml(source) if source is not None else {}
    return build_config(data, source, os.environ if env is None else env, overrides)
