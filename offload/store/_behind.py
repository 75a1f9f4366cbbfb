"""Copies held back: a copy the caller changed (``mark_dirty``) that stays where it is, its
write home left for later, because the bytes will be read from it again soon.

The optimizer's update in the next forward writes a parameter group's new bytes into its
host copy; the forward reads them from there, and so does the backward after it. Written
home at once and dropped, the group would be read back from the disk for the backward;
held back, it is written home when the backward has used it (``flush_behind``), or when
room is needed first (``shed_behind``: the oldest first, which a backward reaches last).
Either way it is written once per change, and every reader meanwhile gets the newest bytes
from the copy (``evict`` of a held copy writes it home like any dirty copy).

Part of :class:`~offload.store.TensorStore` (a mixin: the store keeps the records and the
lock).
"""

from __future__ import annotations

from .._signals import DEFER
from ._state import Residency, Tier

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
        """Whether ``key`` has a copy held back now (one evicted since is not)."""
        with self._cond:
            tier = self._behind.get(key)
            record = self._tensors.get(key)
            copy = record.copies.get(tier) if tier is not None and record is not None else None
            if copy is None or copy.state is not Residency.RESIDENT or not copy.dirty:
                self._behind.pop(key, None)
                return False
            return True

    def flush_behind(self, key: str) -> None:
        """Start writing ``key``'s held copy home (dropped once written); nothing if none."""
        with DEFER, self._cond:
            tier = self._behind.pop(key, None)
            if tier is not None and key in self._tensors:
                self.evict(key, tier)

    def shed_behind(self, nbytes: int) -> int:
        """Start writing home held copies, oldest first, until ``nbytes`` are on their way
        out; returns the bytes started (their room frees as the writes land)."""
        started = 0
        with DEFER, self._cond:
            while self._behind and started < nbytes:
                key = next(iter(self._behind))
                tier = self._behind.pop(key)
                record = self._tensors.get(key)
                if record is None or record.state(tier) is not Residency.RESIDENT:
                    continue
                self.evict(key, tier)
                started += record.nbytes
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
