"""Several ranks (ZeRO-3): a parameter group's gradients are summed in a bucket laid out like
the group's bytes, and once every parameter of the group that reports to this optimizer
has, the bucket is reduce-scattered: each rank receives the mean over ranks of its slice,
fp32, and adds it into its accumulators like a local gradient (``_sink``). Groups some of
whose parameters got no gradient are reduced at the end of backward, in group order (the
same on every rank)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..accel import accelerator_for
from ._layout import ParamEntry

__all__ = ["Reducer"]


@dataclass(eq=False)
class _Bucket:
    """One parameter group's gradients, summed over this backward."""
    manager: Any
    group: Any  # this rank's slice of the group
    data: torch.Tensor | None  # fp32, the whole padded group, in elements of its parameters' size
    itemsize: int
    got: set  # ids of the parameters added
    expected: int  # parameters of the group that report to this optimizer


class Reducer:
    """``sink``: the gradient sink that adds a rank's reduced slice (``drain``/``drain_device``)."""

    def __init__(self, sink: Any, stats: dict):
        self.sink, self.stats = sink, stats
        self._buckets: dict[int, _Bucket] = {}  # id(group) -> its bucket

    def add(self, entry: ParamEntry, grad: torch.Tensor) -> None:
        manager, group, slot = entry.owner
        bucket = self._buckets.get(id(group))
        if bucket is None:
            bucket = self._buckets[id(group)] = self._new(manager, group, grad.device, entry.param)
        at = slot.whole.offset // bucket.itemsize
        bucket.data[at: at + grad.numel()].add_(grad.reshape(-1))
        bucket.got.add(id(entry.param))
        if len(bucket.got) >= bucket.expected:
            self._reduce(bucket)

    def _new(self, manager: Any, group: Any, device: torch.device, p: torch.Tensor) -> _Bucket:
        entries = self.sink.book.entries
        reporting = [s for s in group.slots if s.param.requires_grad and id(s.param) in entries
                     and entries[id(s.param)].hooked]
        sizes = {s.dtype.itemsize for s in reporting}
        if len(sizes) > 1:
            raise ValueError(
                f"parameter group {group.key!r} mixes parameters of dtypes "
                f"{sorted({str(s.dtype) for s in reporting})}; with several ranks a group's gradients are "
                "reduced as one buffer: set OffloadConfig(compute_dtype=...) so they share one")
        itemsize = sizes.pop() if sizes else next(s for s in group.slots if s.param is p).dtype.itemsize
        size = group.nbytes * manager.partition.world // itemsize
        return _Bucket(manager, group, torch.zeros(size, dtype=torch.float32, device=device), itemsize,
                       set(), len({id(s.param) for s in reporting}))

    def _reduce(self, bucket: _Bucket) -> None:
        del self._buckets[id(bucket.group)]
        mine = torch.empty(bucket.group.nbytes // bucket.itemsize, dtype=torch.float32, device=bucket.data.device)
        started = time.perf_counter()
        bucket.manager.partition.reduce_scatter_mean(mine, bucket.data)
        self.stats["reduce_seconds"] += time.perf_counter() - started
        bucket.data = None
        items = [(s.param, s.offset // bucket.itemsize) for s in bucket.group.slots
                 if s.count and id(s.param) in bucket.got]
        acc = accelerator_for(mine.device)
        if acc is not None:
            self.sink.drain_device(items, mine, acc)
        else:
            for p, base in items:
                self.sink.drain(p, mine, base)

    def reduce_pending(self) -> None:
        """End of backward: reduce the groups some of whose parameters got no gradient, in
        the groups' order."""
        pending = sorted(self._buckets.values(), key=lambda b: b.manager.groups.index(b.group))
        for bucket in pending:
            self._reduce(bucket)

    def clear(self) -> None:
        self._buckets.clear()
