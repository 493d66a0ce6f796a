"""The whole file: Config, one field per section."""

from __future__ import annotations

from dataclasses import dataclass, field

from .agent import AgentConfig
from .levers import LeversConfig
from .node import NodeConfig
from .policy import PolicyConfig
from .qos import QosConfig
from .worker import WorkerConfig
from .workers import WorkerEntry


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
