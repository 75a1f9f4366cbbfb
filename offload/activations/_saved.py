"""What autograd saved for backward, as this package keeps it: one record per storage, one
handle per saved tensor.

A record is in one ``SavedState``: IN_PLACE (the storage autograd gave, held here),
OFFLOADED (its bytes in the activation store, in chunks; nothing held), RESTORED (read back
into a buffer of its own for backward) and RELEASED (no handle refers to it any more).
Several saved tensors that view one storage (q, k and v cut from one projection) share a
record, so their bytes move once and their aliasing survives the round trip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SavedState", "SavedRecord", "SavedHandle", "ModifiedSavedTensorError"]


class ModifiedSavedTensorError(RuntimeError):
    """A tensor saved for backward was changed in place afterwards (torch refuses the same)."""


class SavedState(enum.Enum):
    IN_PLACE = "in_place"
    OFFLOADED = "offloaded"
    RESTORED = "restored"
    RELEASED = "released"


_NEXT = {
    SavedState.IN_PLACE: (SavedState.OFFLOADED, SavedState.RELEASED),
    SavedState.OFFLOADED: (SavedState.RESTORED, SavedState.RELEASED),
    SavedState.RESTORED: (SavedState.RELEASED,),
    SavedState.RELEASED: (),
}


@dataclass(eq=False)
class SavedRecord:
    """One storage's bytes, saved by one or more operations of a forward."""

    seq: int  # the order of saving: backward needs the highest first
    nbytes: int
    device: torch.device
    ptr: int  # the storage's address while IN_PLACE (the key of the offloader's index)
    whole: torch.Tensor | None  # uint8 over the whole storage (IN_PLACE, RESTORED), else None
    state: SavedState = SavedState.IN_PLACE
    handles: int = 0  # live SavedHandles: released at 0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) per stored piece
    fetched: set[int] = field(default_factory=set)  # chunks read ahead into the window
    # (saved tensor, its version then) while IN_PLACE: held as autograd would hold it, so a
    # change in place shows in its version counter (views share it)
    sources: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    modified: str | None = None  # set when written after a saved tensor had changed in place
    # written from accelerator memory by offload.activations' DeviceWriter: set once every
    # piece is in the store; ``error`` says why one is not. None: written when offloaded.
    written: Any = None
    pending: int = 0
    error: BaseException | None = None

    def move(self, new: SavedState) -> None:
        if new not in _NEXT[self.state]:
            raise RuntimeError(f"activation record {self.seq}: {self.state.value} -> {new.value} is not a "
                               "valid transition (a bug in offload, please report it)")
        self.state = new

    def key(self, chunk: int) -> str:
        return f"act/{self.seq}/{chunk}"

    def check_versions(self) -> str | None:
        """Why a saved tensor's bytes no longer equal those saved (None if they do)."""
        for tensor, version in self.sources:
            if tensor._version != version:
                return (f"a tensor of shape {tuple(tensor.shape)} saved for backward at version {version} is "
                        f"now at version {tensor._version}")
        return None


class SavedHandle:
    """What autograd keeps instead of a saved tensor: its record and how to view it."""

    __slots__ = ("owner", "record", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, owner: Any, record: SavedRecord, tensor: torch.Tensor):
        self.owner, self.record = owner, record
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tuple(tensor.shape), tuple(tensor.stride())

    def view(self, whole: torch.Tensor) -> torch.Tensor:
        out = torch.empty(0, dtype=self.dtype, device=whole.device)
        return out.set_(whole.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:  # autograd dropped the saved tensor (its node ran or was freed)
        owner = self.owner
        if owner is not None:
            owner.handle_dropped(self.record)
