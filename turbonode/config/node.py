"""[node]: the node's own settings."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import opt


@dataclass
class NodeConfig:
    name: str = opt("", help="the node's name: the `node` label of every metric both daemons export ('' = hostname)")
