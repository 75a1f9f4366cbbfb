"""Page-aligned host buffers (the pool of them: ``_buffers``).

Note: why mmap. ``torch.empty`` on the CPU is only 64-byte aligned and CPU-only torch
cannot pin, while O_DIRECT needs addresses aligned to the logical block size. An
anonymous ``mmap`` is page aligned, and ``torch.frombuffer`` views it without a copy.
With a device the same pages are registered (``cudaHostRegister`` on CUDA) so that one
buffer serves both the disk (O_DIRECT) and an asynchronous host-to-device copy.
"""

from __future__ import annotations

import logging
import mmap
import sys
import weakref

import torch

from .._tensors import lasting
from ..accel import Accelerator

__all__ = ["HostBuffer", "round_up", "PAGE_SIZE"]

log = logging.getLogger(__name__)
PAGE_SIZE = mmap.PAGESIZE
_HUGE = 2 << 20  # buffers from this size up ask for transparent huge pages
_RESIZABLE = True  # False once the system refused to resize an anonymous mapping (no mremap)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HostBuffer:
    """``nbytes`` of page-aligned host memory (rounded up to whole pages).

    ``pin``: the accelerator to page-lock the memory for (its asynchronous copies need
    it); ``pinned`` says whether that happened. ``fault_in=False`` leaves the pages to be
    faulted in by their first use (see BufferPool).
    """

    def __init__(self, nbytes: int, *, pin: Accelerator | None = None, fault_in: bool = True):
        if nbytes < 0:
            raise ValueError(f"HostBuffer size must be >= 0, got {nbytes}")
        self.nbytes = round_up(max(nbytes, 1), PAGE_SIZE)
        # Note: every page is faulted in now unless fault_in=False. A direct transfer from
        # never-touched anonymous pages is much slower (measured: 2.0 against 2.7-3.1 GB/s
        # for O_DIRECT writes here), and the budget counts these bytes anyway.
        # Note: buffers of 2 MiB and more ask for transparent huge pages first. A buffer
        # made of scattered 4 KiB pages needs many more DMA segments per request: reads into
        # optimizer slots allocated after model construction measured 1.1-1.3 GB/s, the same
        # slots on huge pages 2.8-2.9 GB/s (this VM's disk; docs/benchmarks.md).
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        huge = self.nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE")
        if not huge and fault_in:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, self.nbytes, flags=flags)
        if huge:
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError as err:  # THP disabled in this kernel: ordinary pages, same bytes
                log.debug("no transparent huge pages for a %d-byte buffer: %s", self.nbytes, err)
        with lasting():  # (a buffer made during an inference-mode forward serves later steps)
            if huge and fault_in:
                torch.frombuffer(self._map, dtype=torch.uint8)[::PAGE_SIZE].zero_()
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self._bytes.data_ptr()
        self._users = _sharers(self._bytes)  # (the counts with nothing sharing it)
        self.pinned = bool(pin is not None and pin.pin(self.address, self.nbytes))
        self._finalizer = weakref.finalize(self, HostBuffer._release, pin if self.pinned else None, self.address)

    @staticmethod
    def _release(pinned_for: Accelerator | None, address: int) -> None:
        if pinned_for is not None:
            pinned_for.unpin(address)

    @property
    def bytes(self) -> torch.Tensor:
        """The whole buffer as a 1-D uint8 tensor (shares memory; a new alias each time, so
        that every holder counts against ``resize``)."""
        return self._bytes[:]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``numel * itemsize`` bytes as a tensor of ``dtype`` and ``shape``."""
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.nbytes:
            raise ValueError(f"view of {nbytes} bytes does not fit a {self.nbytes}-byte buffer")
        with lasting():  # (a dtype view made in inference mode is an inference tensor, unwritable after it)
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            return self._bytes[:nbytes].view(dtype).view(shape)

    def resize(self, nbytes: int, *, fault_in: bool = True) -> bool:
        """Make the buffer ``nbytes`` (whole pages) in place, keeping the pages both sizes
        share (``mremap``: no page of them zeroed or faulted in again); True if done. Not
        done (False, the buffer unchanged) for a pinned buffer, while anything shares it (a
        view, a ``.bytes`` tensor, its storage object, a memoryview: the pages may move and
        leave it on unmapped memory), or where the system cannot resize an anonymous
        mapping. ``fault_in`` as for a new buffer, for the pages added."""
        global _RESIZABLE
        size = round_up(max(nbytes, 1), PAGE_SIZE)
        if size == self.nbytes:
            return True
        if not _RESIZABLE or self.pinned or self._map is None or self._users is None \
                or _sharers(self._bytes) != self._users:
            return False
        old = self.nbytes
        self._bytes = None
        try:
            self._map.resize(size)
        except BufferError as err:  # (a memoryview of it is alive)
            log.debug("a %d-byte host buffer not resized while exported: %s", old, err)
            size = old
        except (OSError, ValueError, SystemError, AttributeError) as err:  # (no mremap; from Python 3.15 no method)
            log.debug("anonymous mappings cannot be resized here (%s): the pool maps new buffers", err)
            _RESIZABLE, size = False, old
        with lasting():
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
            if size > old and size >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
                try:  # (the whole mapping: a part below 2 MiB before would keep its first frame small)
                    self._map.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            if size > old and fault_in:
                self._bytes[old::PAGE_SIZE].zero_()
        self.nbytes, self.address = size, self._bytes.data_ptr()
        self._users = _sharers(self._bytes)
        return size != old

    def shared(self) -> bool:
        """Whether a tensor made from this buffer (a view of it) is still alive somewhere."""
        return self._users is not None and self._map is not None and _sharers(self._bytes) != self._users

    @property
    def mapping(self) -> mmap.mmap | None:
        """The mapping itself (None once closed): it lives while a tensor made from it does."""
        return self._map

    def memoryview(self, nbytes: int | None = None) -> memoryview:
        return memoryview(self._map)[: self.nbytes if nbytes is None else nbytes]

    def close(self) -> None:
        """Unpin now; unmapped with the last reference: at once unless a tensor made from the
        buffer is still alive, then with that tensor. (A tensor from ``torch.frombuffer``
        references the mapping object but does not lock it: closing the mapping under a live
        one would leave it pointing at unmapped memory, a crash at its next use.)"""
        self._finalizer()
        self._bytes = None
        if self._map is not None and sys.getrefcount(self._map) > 2:  # (this attribute, the call's argument)
            log.debug("a %d-byte host buffer closed while a tensor views it: unmapped with that tensor", self.nbytes)
        self._map = None


def _sharers(tensor: torch.Tensor) -> tuple[int, int] | None:
    """How many tensors share ``tensor``'s memory (views included) and how many references
    its storage object has (a caller may keep that instead), or None where this torch does
    not say (then nothing is resized). Compared with the counts taken when nothing shared it."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = tensor.untyped_storage()
    return count(storage._cdata), sys.getrefcount(storage)
