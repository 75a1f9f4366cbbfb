"""``data_ptr()`` of an offloaded parameter whose bytes are not in memory.

Code outside a module's forward asks for a parameter's address mostly to compare it: PEFT's
``merge_and_unload`` tells tied embeddings from untied ones by ``data_ptr()``, as do
checks for shared storage. The parameter's bytes are on another tier there, so no real
address exists. Each parameter gets one instead inside a range of virtual addresses this
process reserves with no access (``PROT_NONE``, nothing committed): equal for tied
parameters (one parameter object, one slot), distinct otherwise, distinct from every real
tensor's address, and stable while the model is wrapped. Reading or writing through it
faults at once instead of touching bytes that are not the parameter's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
from typing import Iterable

from ._groups import ParamSlot

__all__ = ["ReservedAddresses"]

_ALIGN = 64  # (as torch aligns its own allocations)
_PROT_NONE = 0
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_libc = None


def _c_library():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


class ReservedAddresses:
    """Addresses for the slots of one wrapped model, reserved at the first question."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base: int | None = None
        self._size = 0
        self._offsets: dict[int, int] = {}  # id(slot) -> offset in the range

    def address(self, slot: ParamSlot, slots: Iterable[ParamSlot]) -> int:
        """``slot``'s address; ``slots``: every slot of the model (the range is laid out for
        all of them at once, so an address never changes)."""
        with self._lock:
            if self._base is None:
                self._reserve(slots)
            return self._base + self._offsets[id(slot)]

    def _reserve(self, slots: Iterable[ParamSlot]) -> None:
        at = 0
        for slot in slots:
            if id(slot) not in self._offsets:
                self._offsets[id(slot)] = at
                at += -(-max(slot.nbytes, 1) // _ALIGN) * _ALIGN
        size = -(-max(at, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        libc = _c_library()
        base = libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"could not reserve {size} bytes of address space for data_ptr()")
        self._base, self._size = base, size

    def close(self) -> None:
        with self._lock:
            if self._base is not None:
                _c_library().munmap(self._base, self._size)
            self._base, self._offsets = None, {}
