"""The store's records: one per stored tensor, and in it one per copy in a tier."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..io import HostBuffer, OffloadIOError
from ._state import Residency, StoreError, Tier

__all__ = ["TierCopy", "StoredTensor", "FASTEST_FIRST", "lost_error", "as_bytes"]

FASTEST_FIRST = (Tier.DEVICE, Tier.HOST, Tier.NVME)


@dataclass(eq=False)
class TierCopy:
    """One copy of a stored tensor in one tier: its state, its slot and what it holds."""

    tier: Tier
    state: Residency = Residency.ABSENT
    slot: Any = None
    stage: HostBuffer | None = None  # host bounce buffer of a transfer between two non-host tiers
    valid: bool = False  # holds the newest bytes
    dirty: bool = False  # holds bytes newer than the home copy
    readers: int = 0  # transfers reading from this slot right now
    drop_when_idle: bool = False
    error: BaseException | None = None
    priority: int = 1
    version: int = 0  # the record's version when the load into this copy started
    short_of_staging: bool = False  # queued: its tier had room, the host staging buffers not


_SERIALS = itertools.count()


@dataclass(eq=False)
class StoredTensor:
    """The store's record of one tensor: its metadata and a copy per tier."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    home: Tier
    copies: dict[Tier, TierCopy] = field(default_factory=dict)
    lost: BaseException | None = None  # set when no valid copy survived a failure
    version: int = 0  # bumped by mark_dirty; a write-back only cleans the version it wrote
    writing: bool = False  # a write into the home copy is in flight (one at a time: the newest lands last)
    next_write: TierCopy | None = None  # a copy (storing) whose write starts when that one lands
    serial: int = field(default_factory=lambda: next(_SERIALS))  # (a put's new record: never an old one's)

    def copy(self, tier: Tier) -> TierCopy:
        if tier not in self.copies:
            self.copies[tier] = TierCopy(tier)
        return self.copies[tier]

    def state(self, tier: Tier) -> Residency:
        copy = self.copies.get(tier)
        return copy.state if copy is not None else Residency.ABSENT


def lost_error(record: StoredTensor) -> Exception:
    """What to raise for a tensor whose bytes no copy holds: an I/O error keeps its class
    (a DiskFullError stays one), anything else becomes a StoreError."""
    context = f"tensor {record.key!r} is lost"
    fix = "Its bytes were never stored: put it again (a wrapped model: load a checkpoint)"
    if isinstance(record.lost, OffloadIOError):
        return record.lost.with_context(context, fix)
    return StoreError(f"{context}: {record.lost}. {fix}")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s bytes (copied to contiguous when needed)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
