"""Page-aligned host buffers and a pool of them under a byte budget.

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
import threading
import time
import weakref

import torch

from .._signals import DEFER, wait as _wait
from .._tensors import lasting
from .._units import format_size
from ._registry import leave, register
from ..accel import Accelerator
from ._errors import BudgetError

__all__ = ["HostBuffer", "BufferPool", "round_up", "PAGE_SIZE"]

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


class BufferPool:
    """Reusable :class:`HostBuffer` s under a byte budget.

    The budget counts every byte the pool holds, buffers in use and buffers cached for
    reuse alike. Freed buffers are kept by exact size (groups of one model repeat sizes).
    A request of another size that needs their room resizes one of them in place where
    it can (``HostBuffer.resize``: an unpinned buffer nothing shares) and drops others
    only for the rest of the room: mapping a new buffer instead would zero every page of
    it again, and a model whose groups alternate between two sizes did that for most of
    its bytes on every pass.

    ``fault_in=False``: new buffers are not faulted in by the thread that asks for them
    but by their first use. For buffers a read fills first (the groups computed on in host
    memory), that is the I/O thread's read, beside the compute rather than in its way:
    a fresh page costs more than it moves when memory is short (compaction for huge
    pages, reclaim under a full page cache; GPT-2 1.5B's first forward: 1.7 s of 8).
    """

    def __init__(self, budget: int, *, pin: Accelerator | None = None, name: str = "host",
                 fault_in: bool = True):
        if budget <= 0:
            raise ValueError(f"{name} buffer pool budget must be > 0 bytes, got {budget}")
        self.budget, self.pin, self.name, self.fault_in = budget, pin, name, fault_in
        self._free: dict[int, list[HostBuffer]] = {}
        self._held = 0  # bytes of all live buffers: in use + cached
        self._cached = 0
        # bytes in use beyond what was asked for (cached buffers reused for smaller requests),
        # and the most of them allowed: None, no limit
        self._inflation = 0
        self.max_inflation: int | None = None
        self._asked: dict[int, int] = {}  # id(buffer) -> bytes asked, for reused larger ones
        self.peak_bytes = 0
        self.mapped = self.resized = 0  # buffers mapped anew, cached ones resized for another size
        self.left_to_holders = 0  # cached buffers dropped while a tensor still viewed them (never reused)
        self._cond = threading.Condition()
        self._closed = False
        register(self)

    # -- accounting -------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_use_bytes(self) -> int:
        return self._held - self._cached

    def reset_peak(self) -> None:
        with DEFER, self._cond:
            self.peak_bytes = self._held

    # -- acquire / release ------------------------------------------------------------
    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` now, or ``None`` if the budget is full."""
        size = round_up(max(nbytes, 1), PAGE_SIZE)
        self._check_fits(size)
        with DEFER, self._cond:
            return self._take(size)

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> HostBuffer:
        """A buffer of at least ``nbytes``, waiting up to ``timeout`` s for others' releases."""
        size = round_up(max(nbytes, 1), PAGE_SIZE)
        self._check_fits(size)
        deadline = None if timeout is None else time.monotonic() + timeout
        with DEFER, self._cond:
            while True:
                buf = self._take(size)
                if buf is not None:
                    return buf
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BudgetError(
                        f"{self.name} buffer pool: {size} bytes not free within {timeout}s "
                        f"({self.in_use_bytes} of {self.budget} bytes in use); release buffers "
                        f"or raise the {self.name} budget"
                    )
                _wait(self._cond, remaining)

    def release(self, buf: HostBuffer) -> None:
        with DEFER, self._cond:
            asked = self._asked.pop(id(buf), None)
            if asked is not None:
                self._inflation -= buf.nbytes - asked
            if self._closed:
                self._held -= buf.nbytes
                buf.close()
            else:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._cached += buf.nbytes
            self._cond.notify_all()

    def trim(self) -> None:
        """Unmap every cached buffer."""
        with DEFER, self._cond:
            self._drop_all()

    def close(self) -> None:
        with DEFER, self._cond:
            self._closed = True
            self._drop_all(closing=True)
            self._cond.notify_all()

    # -- internals --------------------------------------------------------------------
    def _check_fits(self, size: int) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} buffer pool is closed")
        if size > self.budget:
            raise BudgetError(
                f"{self.name} buffer of {size} bytes can never fit the {self.name} budget of "
                f"{self.budget} bytes: raise the budget above {size} bytes or use smaller groups"
            )

    def _take(self, size: int) -> HostBuffer | None:
        buf = self._pop_reusable(size)
        if buf is not None:
            return buf
        if self._held + size > self.budget:
            # Note: rather than unmapping cached buffers to map a new one (~5 ms per 16 MB,
            # and a pool full of the wrong sizes would do it on every request: measured 680
            # maps in 8 generated tokens), reuse the smallest cached one that fits, up to 2x
            # the request. The caller is charged the buffer's real size.
            # (within max_inflation: what a user of the pool sized its requests for must
            # still fit; a buffer larger than asked takes room from later requests)
            limit = self.max_inflation
            fits = [s for s in self._free if size <= s <= 2 * size
                    and (limit is None or self._inflation + s - size <= limit)]
            buf = self._pop_reusable(min(fits)) if fits else None
            if buf is not None:
                if buf.nbytes > size:
                    self._asked[id(buf)] = size
                    self._inflation += buf.nbytes - size
                return buf
            buf = self._resize_cached(size)
            if buf is not None:
                return buf
            self._make_room(self._held + size - self.budget)
        if self._held + size > self.budget:
            return None
        buf = HostBuffer(size, pin=self.pin, fault_in=self.fault_in)
        self._held += buf.nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.mapped += 1
        return buf

    def _resize_cached(self, size: int) -> HostBuffer | None:
        """A cached buffer of another size made ``size`` in place: the one that makes the
        room with least to spare, as ``_make_room`` would drop it, else the largest with
        others dropped for the rest. None where none can be (pinned pools, a buffer still
        shared, nothing cached, no room even so)."""
        if self.pin is not None or not self._free:
            return None
        need = self._held + size - self.budget
        enough = [s for s in self._free if s >= need]  # (as _make_room would drop: big buffers kept)
        old = min(enough) if enough else max(self._free)
        buf = self._pop_reusable(old)  # (held still counts it)
        if buf is None:  # (each one of that size is still viewed: the room comes from dropping)
            return None
        over = self._held - old + size - self.budget
        if over > 0:
            self._make_room(over)
        if self._held - old + size > self.budget or not buf.resize(size, fault_in=self.fault_in):
            self._free.setdefault(old, []).append(buf)
            self._cached += old
            return None
        self._held += size - old
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.resized += 1
        return buf

    def _pop_reusable(self, size: int) -> HostBuffer | None:
        """A cached buffer of ``size`` that nothing views any more, or None. One a tensor still
        views (a view of a weight kept past its module's forward: a custom Function's
        ``ctx.wt = w.t()``, an output the hooks cannot see into; a graph recomputed by a
        checkpoint, briefly) is not handed out: reused, it would give that holder another
        tensor's bytes. It stays cached for when its views are gone (``_drop`` says what
        happens to it when the room is needed first)."""
        bufs = self._free.get(size, [])
        for i in range(len(bufs) - 1, -1, -1):
            if not bufs[i].shared():
                buf = bufs.pop(i)
                if not bufs:
                    del self._free[size]
                self._cached -= size
                return buf
        return None

    def _drop(self, buf: HostBuffer, *, closing: bool = False) -> None:
        """Unmap a cached buffer (popped) and stop counting it. One a tensor still views is
        left to that tensor, as torch leaves memory to a view: unmapped with its last view,
        counted by ``pool_bytes()`` beside the pools until then. (At close, the parameters of
        a model never unwrapped still view theirs: expected, so not a warning.)"""
        self._held -= buf.nbytes
        if buf.shared():
            self.left_to_holders += 1
            leave(self.name, buf.nbytes, buf._map)
            (log.warning if self.left_to_holders == 1 and not closing else log.debug)(
                "%s buffer pool: a %s buffer dropped for room is still viewed by a tensor offload did not hand "
                "out (a view of a weight kept past its module's forward, as ctx.wt = w.t() in a custom "
                "Function, or saved by the graph of a forward that raised, which its traceback keeps); it "
                "stays with that tensor, outside the budget (counted in offload.stats' pools)",
                self.name, format_size(buf.nbytes))
        buf.close()

    def _pop_cached(self, size: int) -> HostBuffer:
        bufs = self._free[size]
        buf = bufs.pop()
        if not bufs:
            del self._free[size]
        self._cached -= size
        return buf

    def _drop_all(self, *, closing: bool = False) -> None:
        for size in list(self._free):
            while size in self._free:
                self._drop(self._pop_cached(size), closing=closing)

    def _make_room(self, need: int) -> None:
        """Unmap cached buffers until ``need`` bytes are free or none is left: the one that
        makes the room with least to spare where there is one, else the smallest first.
        Dropping the largest first would drop the big buffers a step keeps reusing (the
        optimizer's shards) for a small request, and map them again at the next shard."""
        fits = [size for size in self._free if size >= need]
        order = [min(fits)] if fits else sorted(self._free)
        freed = 0
        for size in order:
            while size in self._free and freed < need:
                self._drop(self._pop_cached(size))
                freed += size
