"""Reading the next update's state rows during the backward.

The update (in the next forward, or in ``step()``) reads each shard's state rows from NVMe.
In the next forward those reads share the disk with the update's writes and the forward's
own, while during the backward the disk mostly waits: it reads each parameter group once.
So from the backward's gradient hooks, the state rows of the shards the update takes first
(the book's order, the order the next forward uses them in) are asked for into host memory,
one shard at a time (the backward's own reads wait behind no more), as far as the host
budget leaves room beside what the plan reserves for the step: one shard in flight with its
group copies and scratch, the write-back, parameter and device staging. The update then
finds them resident. A gradient accumulator resting on NVMe takes its room from the pool as
the backward opens it: where the pool is short, the copies read ahead are dropped (``shed``:
they are clean, dropping one costs a read) and no more are read in that step.

The copies are clean copies of the rows in the store, so nothing else changes: a write of the
rows (a state dict loaded) replaces them, and the update reads the same bytes either way. A
shard read ahead that takes no step gets its copy dropped at ``step()``. Only the optimizer's
own rows are read this way; parameter groups are the model's, shared with its passes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..store import Residency, Tier
from ._layout import Shard
from ._sizing import largest_in_flight

__all__ = ["BackwardReads"]

log = logging.getLogger(__name__)

_IN_FLIGHT = (Residency.QUEUED, Residency.LOADING)


class BackwardReads:
    """Reads ahead of the update from the gradient hooks (module docstring; the sink calls
    ``advance`` only while no ``update_during_backward`` listens). ``wanted()``: whether this
    optimizer reads ahead at all (one rank), asked once per step."""

    def __init__(self, book: Any, stats: dict, log: Callable[[str, Shard], None], wanted: Callable[[], bool]):
        self.book, self.stats, self.log, self.wanted = book, stats, log, wanted
        self.read: list[Shard] = []  # shards whose rows this asked for, in that order
        self._next = 0  # the book's shards before this one are read or passed over
        self._stopped = False  # no more reads until the next step (room was shed, or an error)
        self._allowed: bool | None = None  # wanted(), asked once per step
        self._margins: dict[int, int] = {}  # id(store) -> host bytes left free (``_margin``)
        self._layout = -1  # len(book.shards) the margins were computed for
        # (a device's gradient adds run on a drain thread, which may shed while a hook reads)
        self._lock = threading.Lock()

    def advance(self) -> None:
        """Ask for the rows of the next shard once the last one asked for has landed, while
        its store's pool has room."""
        if self._stopped or self._next >= len(self.book.shards):
            return
        if self._allowed is None:
            self._allowed = bool(self.wanted())
        if not self._allowed:
            return
        with self._lock:
            try:
                self._advance()
            except Exception:  # noqa: BLE001 - (a read ahead is optional: the update reads what it needs)
                log.debug("offload optimizer: reading state rows during the backward stopped", exc_info=True)
                self._stopped = True

    def _advance(self) -> None:
        shards = self.book.shards
        if self._layout != len(shards):
            self._margins, self._layout = {}, len(shards)
        while not self._stopped and self._next < len(shards):
            if self.read and _loading(self.read[-1]):
                return  # (one at a time: the backward's own reads queue behind no more than one shard)
            shard = shards[self._next]
            if shard.home is Tier.NVME and shard.rows and shard.expected and not shard.store.closed:
                store = shard.store
                if store.state(shard.state_key, Tier.HOST) is Residency.ABSENT:
                    pool = store.staging
                    if pool.budget - pool.in_use_bytes < shard.state_bytes + self._margin(store):
                        return  # (tried again at the next gradient: a write may have landed)
                    self.read.append(shard)  # (first: an interrupt inside the fetch leaves it known)
                    store.fetch(shard.state_key, Tier.HOST)
                    # (read_bytes counts them when the update asks: a fetch served from memory)
                    self.stats["backward_read_bytes"] += shard.state_bytes
                    self.log("read_in_backward", shard)
            self._next += 1

    def shed(self, store: Any, nbytes: int) -> None:
        """The backward needs ``nbytes`` of ``store``'s pool (a gradient accumulator): drop
        copies read ahead there, the newest first, until that room is free or will be once
        the loads under way land; read no more until the next step."""
        with self._lock:
            self._stopped = True
            pool = store.staging
            landing = 0  # bytes that loads under way give back when they land
            while pool.budget - pool.in_use_bytes + landing < nbytes:
                mine = [s for s in self.read if s.store is store]
                if not mine:
                    return
                shard = mine[-1]
                self.read.remove(shard)
                if not store.closed and shard.state_key in store:
                    loading = store.state(shard.state_key, Tier.HOST) is Residency.LOADING
                    store.evict(shard.state_key, Tier.HOST)  # (a load under way is dropped when it lands)
                    landing += shard.state_bytes if loading else 0

    def release(self, keep: list[Shard]) -> None:
        """At ``step()``: drop the copies of shards read ahead that are not in ``keep`` (the
        step's work, which takes the others); the next backward starts over."""
        with self._lock:
            kept = {id(s) for s in keep}
            for shard in self.read:
                if id(shard) not in kept and not shard.store.closed and shard.state_key in shard.store:
                    shard.store.evict(shard.state_key, Tier.HOST)
        self.restart()

    def restart(self) -> None:
        """Start over at the next backward, forgetting what was asked for (copies left by a
        step that failed are taken by a later update, whose fetch finds them)."""
        with self._lock:
            self.read = []
            self._next, self._stopped, self._allowed = 0, False, None

    def _margin(self, store: Any) -> int:
        """Host bytes of ``store``'s pool the reads ahead leave free: what the plan reserves
        beside the resting bytes (``_sizing.check_host_budget``): the largest shard in flight
        with its group copies and scratch, the write-back, parameter and device staging, and
        a plain parameter's gradient copy."""
        margin = self._margins.get(id(store))
        if margin is None:
            placement = self.book.placements.get(id(store))
            mine = [s for s in self.book.shards if s.store is store]
            largest = largest_in_flight(mine, placement.param_home if placement is not None else None)
            staging = (placement.write_back + placement.param_staging + placement.device_staging) if placement else 0
            # (a plain parameter's gradient of another dtype is copied into fp32 from the pool)
            plain = max((s.numel * 4 for s in mine if not s.wrapped), default=0)
            margin = self._margins[id(store)] = largest + staging + plain
        return margin


def _loading(shard: Shard) -> bool:
    store = shard.store
    return not store.closed and shard.state_key in store and store.state(shard.state_key, Tier.HOST) in _IN_FLIGHT
