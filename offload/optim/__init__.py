"""Optimizers with states in host memory or on NVMe, updated on the CPU shard by shard."""

from ._optimizer import OffloadOptimizer
from ._rules import SGD, Adam, AdamW

__all__ = ["AdamW", "Adam", "SGD", "OffloadOptimizer"]
