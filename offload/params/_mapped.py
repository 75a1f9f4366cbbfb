"""Mapped views: on a CPU device over ``io_backend="mmap"``, a group's parameters view its
bytes in the mapped swap file itself (``store.map_view``): no copy, nothing in the device
budget. Prefetching is read-ahead advice to the kernel (``store.advise``). While the newest
bytes are elsewhere (being written home, or a copy written in place) the group is copied
as usual (``StoreCopies``) until they are home again.

Chosen only where the streamed parameters fit the page cache the tier keeps: a view of a
page that is not cached faults it in one page at a time, far slower than a direct read
(docs/benchmarks.md); elsewhere mmap copies like the other backends.
"""

from __future__ import annotations

import torch

from ..accel import host_compute
from ..store import MmapTier, TensorStore, Tier
from ._from_store import StoreCopies
from ._groups import ParamGroup
from ._state import GroupRecord, GroupState, Materialized

__all__ = ["MappedViews"]


class MappedViews(StoreCopies):
    zero_copy = True
    resident_cache = False  # a view costs no read: nothing to keep across passes

    @staticmethod
    def serves(store: TensorStore, device: torch.device, param_tier: str, streamed_bytes: int) -> bool:
        """Whether parameters resting in ``store`` are best computed on as mapped views."""
        nvme = store.tiers.get(Tier.NVME)
        return host_compute(device) and param_tier == "nvme" and isinstance(nvme, MmapTier) \
            and streamed_bytes <= nvme.cache_limit

    def prefetch(self, candidates: list[ParamGroup], room: int) -> list[ParamGroup]:
        for group in candidates:  # advice costs no memory: the window alone bounds it
            self.store.advise(group.key)
        return list(candidates)

    def materialize(self, group: ParamGroup, source: GroupState) -> Materialized:
        got = self.store.map_view(group.key)
        if got is None:  # newest bytes elsewhere: a copy
            return super().materialize(group, source)
        if source is GroupState.AHEAD:  # its read-ahead was advised
            self.coordinator.counts.prefetch_hits += 1
        else:
            self.coordinator.counts.prefetch_misses += 1
        view, release = got
        return Materialized(view, release)

    def give_back(self, group: ParamGroup, record: GroupRecord) -> bool:
        if record.lease is None:  # a copy
            return super().give_back(group, record)
        record.lease()
        return False

    def keep_write(self, group: ParamGroup, record: GroupRecord, certain: bool) -> bool:
        if record.lease is None:
            return super().keep_write(group, record, certain)
        return True  # the view is the home copy itself
