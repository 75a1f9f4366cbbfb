"""Copies held back: a copy the caller changed (``mark_dirty``) that stays where it is, its
write home left for later, because the bytes will be read from it again.

The optimizer's update in the next forward writes a parameter group's new bytes into its
host copy; the forward reads them from there, then the backward, then the next step's
update, which changes them again. Written home at once and dropped, the group would be read
back from the disk for each of those. Held back, it is written home only when the room is
needed (``shed_behind``, the oldest first; the update holds no copy where the pool would be
short), at ``synchronize`` (``flush_all_behind``), or by any ``evict``: once per hold,
however many updates it took meanwhile, and every reader gets the newest bytes from it.

A wait for a home copy that such a change made stale brings it up to date first
(``_bring_home``), keeping the changed copy where it is.

Part of :class:`~offload.store.TensorStore` (a mixin: the store keeps the records and the
lock).
"""

from __future__ import annotations

import time

from .._signals import DEFER, wait as _wait
from ._records import StoredTensor
from ._state import Residency, StoreError, Tier

__all__ = ["WriteBehind"]


class WriteBehind:
    """The held copies, oldest first (``self._behind``: key -> tier, made by the store)."""

    def hold_back(self, key: str, tier: Tier | str) -> None:
        """``mark_dirty(key, tier)``, and leave the copy there with its write home owed."""
        tier = Tier.parse(tier)
        with DEFER, self._cond:
            self.mark_dirty(key, tier)
            self._behind.pop(key, None)  # (held again: now the newest)
            if tier is not self._record(key).home:  # (a home copy is written at once)
                self._behind[key] = tier

    def held_back(self, key: str) -> bool:
        """Whether ``key`` has a copy held back now (one evicted or replaced since is not)."""
        with self._cond:
            tier = self._behind.get(key)
            record = self._tensors.get(key)
            copy = record.copies.get(tier) if tier is not None and record is not None else None
            if copy is None or copy.state is not Residency.RESIDENT or not copy.dirty:
                self._behind.pop(key, None)
                return False
            return True

    def unhold(self, key: str) -> bool:
        """Stop holding ``key``'s copy back without writing it (it stays changed, its write
        owed: the caller is about to change it again, and holds it back or evicts it after);
        whether it was held."""
        with self._cond:
            held = self.held_back(key)
            self._behind.pop(key, None)
            return held

    def flush_behind(self, key: str) -> None:
        """Start writing ``key``'s held copy home (dropped once written); nothing if none."""
        with DEFER, self._cond:
            tier = self._behind.get(key)
            if self.unhold(key):
                self.evict(key, tier)

    def shed_behind(self, nbytes: int) -> int:
        """Start writing home held copies, oldest first, until ``nbytes`` are on their way
        out; returns the bytes started (their room frees as the writes land)."""
        started = 0
        with DEFER, self._cond:
            while self._behind and started < nbytes:
                key = next(iter(self._behind))
                started += self._tensors[key].nbytes if self.held_back(key) else 0
                self.flush_behind(key)
        return started

    def flush_all_behind(self) -> None:
        """Start writing home every held copy."""
        with DEFER, self._cond:
            for key in list(self._behind):
                self.flush_behind(key)

    @property
    def behind_bytes(self) -> int:
        """Bytes of the copies held back now."""
        with self._cond:
            return sum(self._tensors[k].nbytes for k in list(self._behind) if self.held_back(k))

    def _bring_home(self, record: StoredTensor, deadline: float | None = None) -> None:
        """The home copy is stale: another copy was changed in place (``mark_dirty``; a
        parameter written on the device between steps) and not written home yet. Write it
        home now, keeping it where it is (as a fetch keeps a copy being written), and wait
        for the write (until ``deadline``, ``time.monotonic()``): a reader of the home copy
        gets the newest bytes."""
        home = record.copies[record.home]
        while not home.valid:
            newest = next((c for c in record.copies.values() if c.valid and c.dirty), None)
            if newest is None:
                raise StoreError(f"tensor {record.key!r}: no copy holds its newest bytes")
            self._raise_error(record, newest)  # (a write home that failed: raised, not retried)
            if not record.writing and newest.state is Residency.RESIDENT:
                self._backend(newest.tier).fence(newest.slot)  # (as evict: the copy waits for the caller's writes)
                asked, newest.drop_when_idle = newest.drop_when_idle, False
                newest.readers += 1  # (a write that lands at once must not drop it: held through the start)
                try:
                    self._start_write(record, newest, blocking=True)
                finally:
                    newest.drop_when_idle = asked  # (an eviction asked before this goes on as asked)
                    self._reader_done(record, newest)
                if newest.state is Residency.STORING:
                    self._move(record, newest, Residency.RESIDENT)
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"tensor {record.key!r}: its home copy not brought up to date in time")
            _wait(self._cond, remaining)
