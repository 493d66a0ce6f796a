"""Contracts shared by the agent, the worker and turboctl.

This package must stay import-light: the agent imports it, and importing the agent
must never import torch.
"""

__version__ = "0.1.0"
