"""Reading a shard's held gradient sums for ``p.grad`` (``_grads``).

A sum resting in host memory is read where it rests. One on NVMe is read whole into a
copy; a loop over ``p.grad`` of the parameters in one shard (a per-layer norm for a log,
``clip_grad_value_``) would read the shard once per parameter, so the last copy read is
kept and reused while the store's record of the sum is unchanged: any put, in-place
overwrite or ``mark_dirty`` gives the record a new serial or version, so a kept copy is
never older than the sum.
"""

from __future__ import annotations

from typing import Any

import torch

from ..store import Tier
from ._moved import count

__all__ = ["GradientReads", "read_sum"]


def read_sum(shard: Any) -> torch.Tensor:
    """The shard's gradient accumulator: the resting tensor in host memory, else a copy
    the caller owns (and may change)."""
    if shard.grad_home is Tier.HOST:
        return shard.store.wait(shard.grad_key, Tier.HOST)
    return shard.store.read_copy(shard.grad_key)


class GradientReads:
    """Read-only reads of held sums, with the last NVMe copy kept (module docstring)."""

    def __init__(self, stats: dict):
        self._stats = stats
        self._kept: tuple[Any, tuple[int, int], torch.Tensor] | None = None  # (shard, record's mark, copy)

    def sum_of(self, shard: Any) -> torch.Tensor:
        """The shard's sum, not to be changed by the caller."""
        if shard.grad_home is Tier.HOST:
            return read_sum(shard)
        record = shard.store.info(shard.grad_key)
        mark = (record.serial, record.version)  # (taken before the read: a change during it is seen next time)
        if self._kept is not None and self._kept[0] is shard and self._kept[1] == mark:
            return self._kept[2]
        self._kept = None  # (its memory goes before the next copy is made)
        copy = read_sum(shard)
        self._stats["read_bytes"] += copy.numel() * copy.element_size()
        count(self._stats, "gradients", read=copy.numel() * copy.element_size())
        self._kept = (shard, mark, copy)
        return copy

    def forget(self) -> None:
        self._kept = None
