"""Optimizers with states in host memory or on NVMe, updated on the CPU shard by shard."""

from ._optimizer import SGD, Adam, AdamW, OffloadOptimizer

__all__ = ["AdamW", "Adam", "SGD", "OffloadOptimizer"]
