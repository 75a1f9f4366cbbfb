"""Gathered slices: with several ranks a rank's store holds its slice of each group (key =
the group's key), and materializing all-gathers the whole group into a device slot of its
own (counted in the device budget, freed at release). From the second pass each
acquisition also issues the asynchronous all-gather of the next group of the recorded
order, so it runs while the module computes.

Note: one order of collectives. Every rank must issue the same collectives in the same
order, so every decision that leads to one (gather ahead or not, which read-aheads to drop
for room) uses this materializer's own count of the device bytes the coordinator holds
(``used_bytes``), never the tier's count, which moves with the timing of reads and differs
from rank to rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .._tensors import lasting
from ..io import BudgetError
from ..store import TensorStore, Tier
from ._from_store import StoreCopies
from ._groups import ParamGroup
from ._state import GroupRecord, GroupState, Materialized, PendingGather

__all__ = ["GatheredSlices"]

log = logging.getLogger(__name__)


class GatheredSlices(StoreCopies):
    def __init__(self, store: TensorStore, home: Tier, *, device_budget: int, partition: Any):
        super().__init__(store, home, device_budget=device_budget)
        self.partition = partition  # an offload.distributed.Partition
        self.pending: dict[ParamGroup, PendingGather] = {}  # all-gathers issued ahead of use
        self._warned = False

    def used_bytes(self) -> int:
        """The device bytes the coordinator's bookkeeping says are held: slices it fetched and
        has not dropped, whole groups gathered or being gathered."""
        device, world = self.device_tier, self.partition.world
        total = 0
        for group, record in self.coordinator.records.items():
            part = self.partition.slice_bytes(group.nbytes)
            if self._holds_slice(record):
                total += device.slot_size(part)
            if record.state.viewed or group in self.pending:
                total += device.slot_size(part * world)
        return total

    def _holds_slice(self, record: GroupRecord) -> bool:
        return self.home is Tier.DEVICE or record.state is not GroupState.RELEASED

    def prefetch(self, candidates: list[ParamGroup], room: int) -> list[ParamGroup]:
        device = self.device_tier
        counted = self.used_bytes()  # counted once, then kept up
        started = []
        for group in candidates:
            if group.nbytes > room or counted + device.slot_size(group.nbytes) > self.device_budget:
                break
            self.store.fetch(group.key, Tier.DEVICE, priority=1)
            started.append(group)
            room -= group.nbytes
            counted += device.slot_size(self.partition.slice_bytes(group.nbytes))
        return started

    def materialize(self, group: ParamGroup, source: GroupState) -> Materialized:
        counts = self.coordinator.counts
        pending = self.pending.pop(group, None)
        if pending is not None:  # gathered ahead of use
            counts.prefetch_hits += 1
            started = time.perf_counter()
            pending.work.wait()
            counts.gather_seconds += time.perf_counter() - started
            return Materialized(pending.whole, pending.slot)
        mine = self.load(group, source)
        size = mine.numel() * self.partition.world
        slot_size = self.device_tier.slot_size(size)
        self.coordinator.make_room(size)
        if self.used_bytes() + slot_size > self.device_budget:
            raise BudgetError(
                f"device_budget {self.device_budget} bytes cannot hold parameter group {group.key!r} "
                f"gathered from {self.partition.world} ranks ({size} bytes) next to the "
                f"{self.used_bytes()} bytes in use: raise device_budget")
        slot, whole = self._buffer(group, size)
        started = time.perf_counter()
        self.partition.all_gather(whole, mine)
        counts.gather_seconds += time.perf_counter() - started
        return Materialized(whole, slot)

    def _buffer(self, group: ParamGroup, size: int) -> tuple[Any, torch.Tensor]:
        """(slot, tensor) of ``size`` bytes on the device for a gathered group: a device-tier
        slot, counted in the budget. Room is decided by our own count, the same on every
        rank; where the tier holds more at that moment (a copy evicted while loading frees
        its room when it lands, a reused pool buffer may be larger than asked), the buffer
        is allocated beside the tier, logged once and counted in
        ``gather_over_budget_bytes``: the ranks must issue the same collectives."""
        device = self.device_tier
        slot = device.allocate(size)
        if slot is not None:
            device.consume(slot)  # (used by this stream: freed, it is not reused before its kernels finish)
            return slot, device.tensor(slot)[:size]
        counts = self.coordinator.counts
        counts.gather_over_budget_bytes = max(counts.gather_over_budget_bytes, size)
        if not self._warned:
            self._warned = True
            log.warning("offload: gathering parameter group %r (%d bytes) beside the device tier, which "
                        "holds %d of %d bytes now (pool rounding or copies still loading); further cases "
                        "are counted in stats()['gather_over_budget_bytes']", group.key, size,
                        device.used_bytes, self.device_budget)
        with lasting():
            return None, torch.empty(size, dtype=torch.uint8, device=self.coordinator.device)

    def give_back(self, group: ParamGroup, record: GroupRecord) -> bool:
        if record.lease is not None:  # (its kernels are recorded on it: _buffer)
            self.device_tier.free(record.lease)
        return True  # the slice's device copy stays until evicted

    def keep_write(self, group: ParamGroup, record: GroupRecord, certain: bool) -> bool:
        if certain:
            raise RuntimeError(
                f"parameter group {group.key!r} was written in place inside its module's forward with the "
                "model partitioned over ranks: each rank stores a slice, not the gathered copy that was "
                "written. Write parameters before offload.wrap, or load them with offload.load_checkpoint")
        return False  # (a .data handed out, not written: nothing to keep)

    def evict(self, group: ParamGroup) -> None:
        pending = self.pending.get(group)
        if pending is not None:
            pending.work.wait()  # it reads the slice: done before the slice goes
        super().evict(group)

    def after_acquire(self) -> None:
        """Start the all-gather of the next group of the recorded order, so it runs while this
        module computes. Whether to start it depends only on what every rank agrees on (the
        recorded order, our own count, the budget), never on how fast a read or a peer was."""
        coordinator = self.coordinator
        nxt = coordinator.schedule.next_in_pass()
        if nxt is None or nxt in self.pending:
            return
        record = coordinator.records[nxt]
        if record.state.viewed:
            return
        device, world = self.device_tier, self.partition.world
        size = self.partition.slice_bytes(nxt.nbytes) * world
        holds = self._holds_slice(record)
        # room by our own count, with as much again to spare (the tier's buffers may be
        # larger than asked: pool reuse); else it is gathered when used
        if self.used_bytes() + 2 * device.slot_size(size) + \
                (0 if holds else device.slot_size(size // world)) > self.device_budget:
            return
        if not holds:
            coordinator.log_event("fetch", nxt, "prefetch")
            self.store.fetch(nxt.key, Tier.DEVICE, priority=0)
            coordinator.note_read_ahead(nxt)
        mine = self.store.wait(nxt.key, Tier.DEVICE)
        slot, whole = self._buffer(nxt, size)
        work = self.partition.all_gather(whole, mine, async_op=True)
        self.pending[nxt] = PendingGather(work, slot, whole)
        coordinator.counts.gathered_ahead += 1

    def cancel_ahead(self, group: ParamGroup | None = None) -> None:
        """Discard gathers issued ahead (the group's bytes changed, or the order did); each
        collective was issued by every rank and completes."""
        for target in list(self.pending) if group is None else [group]:
            pending = self.pending.pop(target, None)
            if pending is None:
                continue
            pending.work.wait()
            if pending.slot is not None:
                self.device_tier.free(pending.slot)
