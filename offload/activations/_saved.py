"""What autograd saved for backward, as this package keeps it: one record per storage, one
handle per saved tensor, one source per handle.

A record is in one ``SavedState``: IN_PLACE (the storage autograd gave, held here),
OFFLOADED (its bytes in the activation store, in pieces; nothing held), RESTORED (read back
into a buffer of its own for backward) and RELEASED (no handle refers to it any more).
Several saved tensors that view one storage (q, k and v cut from one projection) share a
record, so their bytes move once and their aliasing survives the round trip.

Note: in-place changes. Torch refuses a backward that needs a tensor changed in place after
it was saved; with saved-tensor hooks the check is the hooks' job. Each handle's source keeps
the version the tensor had when saved and a tensor of no storage that shares its version
counter (``detach()`` shares the counter, ``set_()`` then drops the storage, the version kept
as it was): any in-place change of the saved tensor or of a view of its base moves that
counter, whenever it happens and whether or not the tensor is still alive, so the read
refuses it as torch does, without holding the tensor's memory. While its record is in place
the source also holds the (detached) tensor itself, which is what a read returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SavedState", "SavedSource", "SavedRecord", "SavedHandle", "ModifiedSavedTensorError", "KeptTensor", "kept"]


class ModifiedSavedTensorError(RuntimeError):
    """A tensor saved for backward was changed in place afterwards (torch refuses the same)."""


class KeptTensor:
    """A saved tensor autograd keeps as itself (not offloaded: small, resident, of a kind the
    store does not hold) with the version it was saved at. Torch checks the version of what it
    saves, not of what saved-tensor hooks return: without this, a tensor changed in place
    between forward and backward would reach the gradient silently."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, tensor._version

    def get(self) -> torch.Tensor:
        now = self.tensor._version
        if now != self.version:
            raise ModifiedSavedTensorError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.tensor.type()} {list(self.tensor.shape)}] is at version {now}; expected version "
                f"{self.version} instead (checked by offload's saved-tensor hooks, as torch checks; torch's "
                "allow_mutation_on_saved_tensors does not reach past them). Hint: make the operation out of place "
                "(e.g. x = x * 2 instead of x.mul_(2)), or change it after backward")
        return self.tensor


def kept(tensor: torch.Tensor) -> Any:
    """What autograd keeps for ``tensor`` saved as itself: a KeptTensor, or the tensor where it
    has no version to check (an inference tensor, a meta tensor)."""
    if tensor.is_inference() or tensor.device.type == "meta":
        return tensor
    return KeptTensor(tensor)


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


class SavedSource:
    """The tensor one handle stands for, and its version when saved (see the module's note)."""

    __slots__ = ("held", "counter", "version", "shape", "stale")

    def __init__(self, tensor: torch.Tensor):
        self.held: torch.Tensor | None = tensor.detach()
        counter = tensor.detach()
        with torch.autograd._unsafe_preserve_version_counter(counter):
            counter.set_()  # (no storage: the version counter alone)
        self.counter, self.version, self.shape = counter, tensor._version, tuple(tensor.shape)
        self.stale: str | None = None  # why the bytes kept are not those saved

    def look(self) -> None:
        """Note a change of the tensor since it was saved."""
        if self.stale is None and self.counter._version != self.version:
            self.stale = (f"a tensor of shape {self.shape} saved for backward at version {self.version} is now "
                          f"at version {self.counter._version}")

    def let_go(self) -> None:
        """The record's bytes are written: look once more, and stop holding the tensor."""
        self.look()
        self.held = None

    def check(self) -> None:
        self.look()
        if self.stale is not None:
            raise ModifiedSavedTensorError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation "
                f"({self.stale}); offload's activation offload refuses it as torch does. Hint: make the operation "
                "out of place (e.g. x = x + y instead of x += y)")


@dataclass(eq=False)
class SavedRecord:
    """One storage's bytes, saved by one or more operations of a forward."""

    seq: int  # the order of saving: backward needs the highest first
    nbytes: int
    ptr: int  # the storage's address (the key of the offloader's index)
    storage: Any  # a weak reference to the storage: identity and liveness (its address may be reused)
    whole: torch.Tensor | None  # uint8 over the whole storage (IN_PLACE, RESTORED), else None
    state: SavedState = SavedState.IN_PLACE
    handles: int = 0  # live SavedHandles: released at 0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) per stored piece
    fetched: set[int] = field(default_factory=set)  # pieces read ahead into the window
    sources: list[SavedSource] = field(default_factory=list)
    restored_version: int = 0  # whole's version when read back (views share its counter)
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

    @property
    def being_written(self) -> bool:
        return self.written is not None and not self.written.is_set()


class SavedHandle:
    """What autograd keeps instead of a saved tensor: its record, its source, how to view it."""

    __slots__ = ("owner", "record", "source", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, owner: Any, record: SavedRecord, source: SavedSource, tensor: torch.Tensor):
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tuple(tensor.shape), tuple(tensor.stride())
        self.owner, self.record, self.source = owner, record, source

    def view(self, whole: torch.Tensor) -> torch.Tensor:
        """This handle's tensor over a record's bytes; it shares ``whole``'s version counter
        where the dtype divides the bytes (a change made to it in backward shows there)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        if whole.numel() % size == 0 and whole.storage_offset() == 0:
            return whole.view(self.dtype).as_strided(self.size, self.stride, self.offset)
        out = torch.empty(0, dtype=self.dtype, device=whole.device)
        return out.set_(whole.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:  # autograd dropped the saved tensor (its node ran or was freed)
        owner = getattr(self, "owner", None)  # (unset when the constructor raised)
        if owner is not None:
            owner.handle_dropped(self.record)
