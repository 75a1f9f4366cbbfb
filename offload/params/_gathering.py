"""Several ranks: a rank's store holds its slice of each group, and materializing gathers
the whole group into a device slot of its own (counted in the device budget, freed at
release). From the second pass each acquisition also issues the asynchronous all-gather of
the next group of the recorded order, so it runs while the module computes. Collectives
must be issued in one order on every rank, so every decision that leads to one uses the
coordinator's own count of the device bytes it holds, never the tier's, which moves with
the timing of reads.

``Gathering`` is a part of ``Coordinator`` (its state lives there); it is kept apart because
only several ranks use it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..io import BudgetError
from ..store import Tier
from ._groups import ParamGroup

__all__ = ["Gathering"]

log = logging.getLogger(__name__)


class Gathering:
    """The all-gather half of ``Coordinator`` (module docstring)."""

    def _gather(self, group: ParamGroup, live: Any, mine: torch.Tensor) -> torch.Tensor:
        """All ranks' slices of ``group`` into one device buffer: its whole flat bytes."""
        size = mine.numel() * self.partition.world
        device = self.store.tiers[Tier.DEVICE]
        while self.ahead and self._used() + device.slot_size(size) > self.device_budget:
            self._drop_ahead(next(reversed(self.ahead)))
        if self._used() + device.slot_size(size) > self.device_budget:
            raise BudgetError(
                f"device_budget {self.device_budget} bytes cannot hold parameter group {group.key!r} "
                f"gathered from {self.partition.world} ranks ({size} bytes) next to the "
                f"{self._used()} bytes in use: raise device_budget")
        live.gathered, whole = self._gather_buffer(group, size)
        started = time.perf_counter()
        self.partition.all_gather(whole, mine)
        self.gather_seconds += time.perf_counter() - started
        return whole

    def _gather_buffer(self, group: ParamGroup, size: int) -> tuple[Any, torch.Tensor]:
        """(slot, tensor) of ``size`` bytes on the device for a gathered group: a device-tier
        slot, counted in the budget. Room is decided by the coordinator's own count, the same
        on every rank; where the tier holds more at that moment (a copy evicted while loading
        frees its room when it lands, a reused pool buffer may be larger than asked), the
        buffer is allocated beside the tier, logged once and counted in
        ``gather_over_budget_bytes``: the ranks must issue the same collectives."""
        device = self.store.tiers[Tier.DEVICE]
        slot = device.allocate(size)
        if slot is not None:
            return slot, device.tensor(slot)[:size]
        self.gather_over_budget_bytes = max(self.gather_over_budget_bytes, size)
        if "over_budget" not in self._warned:
            self._warned.add("over_budget")
            log.warning("offload: gathering parameter group %r (%d bytes) beside the device tier, which "
                        "holds %d of %d bytes now (pool rounding or copies still loading); further cases "
                        "are counted in stats()['gather_over_budget_bytes']", group.key, size,
                        device.used_bytes, self.device_budget)
        return None, torch.empty(size, dtype=torch.uint8, device=self.device)

    def _gather_ahead(self) -> None:
        """Several ranks: start the all-gather of the next group of the recorded order, so it
        runs while this module computes. Whether to start it depends only on what every rank
        agrees on (the recorded order, the coordinator's own bookkeeping, the budget), never
        on how fast a read or a peer was, so the ranks issue their collectives in one order."""
        p = self.current
        trace = self.traces.get(p.key) if p is not None and not p.diverged else None
        if not trace or p.cursor >= len(trace):
            return  # not past the end of the pass: the optimizer may change the next pass's bytes
        nxt = trace[p.cursor]
        live = self.live[nxt]
        if live.flat is not None or live.pending is not None or nxt in self.parked:
            return
        device = self.store.tiers[Tier.DEVICE]
        size = self.partition.slice_bytes(nxt.nbytes) * self.partition.world
        # room by our own count, with as much again to spare (the tier's buffers may be
        # larger than asked: pool reuse); else it is gathered when used
        if self._accounted_device_bytes() + 2 * device.slot_size(size) + \
                (0 if self._holds_slice(nxt) else device.slot_size(size // self.partition.world)) \
                > self.device_budget:
            return
        if not self._holds_slice(nxt):
            self._log("fetch", nxt, "prefetch")
            self.store.fetch(nxt.key, Tier.DEVICE, priority=0)
            self.ahead[nxt] = None
        mine = self.store.wait(nxt.key, Tier.DEVICE)
        slot, whole = self._gather_buffer(nxt, size)
        work = self.partition.all_gather(whole, mine, async_op=True)
        live.pending = (work, slot, whole)
        self.gathered_ahead += 1

    def _holds_slice(self, group: ParamGroup) -> bool:
        return self.home is Tier.DEVICE or group in self.ahead or bool(self.cached.get(group)) \
            or self.live[group].flat is not None

    def _accounted_device_bytes(self) -> int:
        """Device bytes the coordinator's own bookkeeping says are held: slices it fetched and
        has not dropped, whole groups gathered or being gathered."""
        device = self.store.tiers[Tier.DEVICE]
        world = self.partition.world
        total = 0
        for group, live in self.live.items():
            part = self.partition.slice_bytes(group.nbytes)
            if self._holds_slice(group):
                total += device.slot_size(part)
            if live.flat is not None or live.pending is not None:  # a whole group gathered
                total += device.slot_size(part * world)
        return total

    def _take_pending(self, group: ParamGroup, live: Any) -> None:
        """Use the all-gather issued ahead for ``group``."""
        work, slot, whole = live.pending
        live.pending = None
        self.prefetch_hits += 1
        self.ahead.pop(group, None)
        started = time.perf_counter()
        work.wait()
        self.gather_seconds += time.perf_counter() - started
        live.gathered = slot
        self._point(group, live, whole)

    def _drop_pending(self, group: ParamGroup) -> None:
        """Discard a gather issued ahead (its group's bytes changed, or the order did); the
        collective itself was issued by every rank and completes."""
        live = self.live[group]
        if live.pending is None:
            return
        work, slot, _ = live.pending
        live.pending = None
        work.wait()
        if slot is not None:
            self.store.tiers[Tier.DEVICE].free(slot)
