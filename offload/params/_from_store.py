"""The usual materializer: a group's parameters view the store's device copy of its bytes.

Prefetch is an early ``store.fetch`` at second priority, within what the device tier has
free now (it never waits for room: a fetch for use that finds none drops the farthest
read-aheads, ``Coordinator.make_room``). A use waits for the copy, counted as a stall; a
read ahead that failed is read again at the use (an outage may have ended), and a lasting
fault fails that read too.
"""

from __future__ import annotations

import logging
import time

import torch

from ..io import BudgetError
from ..store import Residency, TensorStore, Tier
from ._groups import ParamGroup
from ._materializer import Materializer
from ._state import GroupRecord, GroupState, Materialized

__all__ = ["StoreCopies"]

log = logging.getLogger(__name__)


class StoreCopies(Materializer):
    def __init__(self, store: TensorStore, home: Tier, *, device_budget: int):
        super().__init__(store, home)
        self.device_budget = device_budget

    def used_bytes(self) -> int:
        return self.device_tier.used_bytes

    def prefetch(self, candidates: list[ParamGroup], room: int) -> list[ParamGroup]:
        device = self.device_tier
        started = []
        for group in candidates:
            if group.nbytes > room or device.used_bytes + device.slot_size(group.nbytes) > self.device_budget:
                break
            self.store.fetch(group.key, Tier.DEVICE, priority=1)
            started.append(group)
            room -= group.nbytes
        return started

    def materialize(self, group: ParamGroup, source: GroupState) -> Materialized:
        try:
            return Materialized(self.load(group, source), None)
        except BudgetError as err:
            raise self.coordinator.room_error(group, err) from None

    def load(self, group: ParamGroup, source: GroupState) -> torch.Tensor:
        """The store's device copy of ``group``, waited for: a prefetch hit when it was read
        ahead or kept, else a miss, fetched now at first priority."""
        coordinator, counts = self.coordinator, self.coordinator.counts
        if source is GroupState.RELEASED:
            counts.prefetch_misses += 1
            if self.store.state(group.key, Tier.DEVICE) is Residency.ABSENT:
                coordinator.make_room(group.nbytes)
                coordinator.log_event("fetch", group, "demand")
                self.store.fetch(group.key, Tier.DEVICE, priority=0)
        else:
            counts.prefetch_hits += 1
        started = time.perf_counter()
        try:
            flat = self.store.wait(group.key, Tier.DEVICE)
        except OSError as err:
            if source is not GroupState.AHEAD:
                raise
            log.info("prefetch of %s failed (%s); reading it again on demand", group.key, err)
            coordinator.make_room(group.nbytes)
            self.store.fetch(group.key, Tier.DEVICE, priority=0)
            flat = self.store.wait(group.key, Tier.DEVICE)
        ended = time.perf_counter()
        counts.stall_seconds += ended - started
        tracer = coordinator.tracer
        if tracer is not None and ended - started > 1e-5:
            tracer.span(f"stall {group.key}", "stall", started, ended, "compute")
        return flat

    def give_back(self, group: ParamGroup, record: GroupRecord) -> bool:
        return True  # the view was the store's device copy: it stays until evicted

    def keep_write(self, group: ParamGroup, record: GroupRecord, certain: bool) -> bool:
        # the device copy now holds the newest bytes: written home when dropped, and any
        # other copy (a host copy read for a checkpoint) no longer counts as current
        self.store.mark_dirty(group.key, Tier.DEVICE)
        return True

    def evict(self, group: ParamGroup) -> None:
        if self.home is not Tier.DEVICE:  # groups resting on the device stay there
            self.store.evict(group.key, Tier.DEVICE)
