"""The NVMe tier on memory-mapped files: the page cache as a free host cache.

``MmapTier`` keeps the same swap files as ``NvmeTier`` (``SwapFiles``: lock, preallocated
files, extents) but moves bytes through a shared mapping of each file instead of O_DIRECT
system calls:

- a read asks the kernel to start reading the extent (``MADV_WILLNEED``) when it is
  issued, then a worker thread copies it from the mapping into the destination (pages
  already cached are copied at memory speed: a model that fits in RAM is read from disk
  once);
- a write goes into the page cache with ``pwrite`` on a worker thread (the same pages the
  mapping shows); the kernel writes the dirty pages back in the background;
- pages it holds on purpose are bounded: extents touched recently are counted (least
  recently used first) and, past ``cache_limit`` bytes (the host budget), the oldest are
  written back (``msync``) and dropped from the page cache (``posix_fadvise DONTNEED``
  and ``MADV_DONTNEED``);
- a file truncated underneath would make a copy from its mapping raise SIGBUS and kill
  the process, so every transfer checks the file's size first and fails with an
  ``OffloadIOError`` naming the file instead.

``cached_bytes`` reports the tier's pages in the page cache (``mincore``), which
``offload.stats`` shows as ``page_cache_bytes``. Transfers run on a few worker threads,
lowest ``priority`` first (a demand read, 0, overtakes queued prefetches, 1), as in the
file engine.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable

import torch

from .._tensors import lasting
from ..io import FileEngine, OffloadIOError
from ._inplace import CheckpointSlot
from ._nvme import Extent, SwapFiles
from ._pagecache import advise_random, advise_willneed, drop_pages, mapping_address, page_span, resident_bytes
from ._state import Tier
from ._tiers import Pending, SwapFileSlots

__all__ = ["MmapTier"]

log = logging.getLogger(__name__)


class _Mapped:
    """One swap file's shared mapping and a uint8 tensor over it."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        advise_random(self.mm)  # no fault-around readahead: the tier says what it will read
        with lasting():  # (mapped during an inference-mode forward, written after it)
            self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.address = mapping_address(self.mm)

    def close(self) -> None:
        """Unmapped with the last reference: at once unless a view handed out is alive, then
        with it (closing the mapping under a live tensor would leave it dangling)."""
        self.tensor = None
        self.mm = None


class MmapTier(SwapFileSlots):
    """Slots are extents of the swap files, moved by copies through shared mappings."""

    def __init__(self, files: SwapFiles, engine: FileEngine, *, threads: int = 4, cache_limit: int = 1 << 62,
                 budget: int | None = None):
        super().__init__(Tier.NVME, budget if budget is not None else 1 << 62)
        self.files, self.engine = files, engine  # the engine only opens and closes the files
        self.cache_limit = cache_limit
        self._maps: dict[str, _Mapped] = {}
        self._maps_lock = threading.Lock()
        self._recent: OrderedDict[tuple[str, int], list] = OrderedDict()  # -> [extent, dirty]
        self._recent_bytes = 0
        self._workers = _PriorityWorkers(max(1, threads), name="offload-mmap")
        self.dropped_bytes = 0
        self.busy_seconds = 0.0  # worker time spent copying

    # -- slots ------------------------------------------------------------------------------
    def free(self, slot: Extent | CheckpointSlot) -> None:
        if isinstance(slot, CheckpointSlot):
            return
        with self._maps_lock:
            entry = self._recent.pop((slot.file.path, slot.offset), None)
            if entry is not None:
                self._recent_bytes -= slot.length
        super().free(slot)

    # -- transfers --------------------------------------------------------------------------
    def read_into(self, slot: Extent | CheckpointSlot, dest: torch.Tensor, nbytes: int, *,
                  priority: int = 1) -> Pending:
        if isinstance(slot, CheckpointSlot):  # (direct reads: a mapping of it would fault page by page)
            return self.read_checkpoint(slot, dest, nbytes, priority)
        mapped = self._mapped(slot)
        self.advise(slot, nbytes)
        self._count(read=nbytes)

        def copy() -> None:
            self._check_size(slot, mapped, "read", nbytes)
            dest[:nbytes].copy_(mapped.tensor[slot.offset: slot.offset + nbytes])
            self._touched(slot, dirty=False)

        return self._submit(copy, priority)

    def write_from(self, slot: Extent, src: torch.Tensor, nbytes: int, *, priority: int = 1) -> Pending:
        if isinstance(slot, CheckpointSlot):
            self.refuse_write(slot)
        mapped = self._mapped(slot)
        self._count(write=nbytes)

        def copy() -> None:
            # Note: pwrite into the page cache, not a store through the mapping: a store
            # into a page that is not cached faults and reads the old page from disk first
            # (4 KiB at a time: 0.15 GB/s measured here), while a write of whole pages does
            # not. The mapping sees the same pages.
            self._check_size(slot, mapped, "write", nbytes)
            data = memoryview(src[:nbytes].numpy()).cast("B")
            done = 0
            while done < nbytes:
                n = os.pwrite(mapped.fd, data[done:], slot.offset + done)
                if n <= 0:
                    raise OffloadIOError("write", slot.file.path, slot.offset + done, nbytes - done, None,
                                         "the OS wrote nothing")
                done += n
            self._touched(slot, dirty=True)

        return self._submit(copy, priority)

    def view(self, slot: Extent, nbytes: int) -> torch.Tensor:
        """The extent's bytes in place, as a uint8 tensor over the mapping with a storage of
        its own (so views of different extents never share a storage). Read-only use."""
        mapped = self._mapped(slot)
        self._check_size(slot, mapped, "read", nbytes)
        self._touched(slot, dirty=False)
        self._count(read=nbytes)  # served to compute, from the page cache or the disk
        with lasting():
            return torch.frombuffer(mapped.mm, dtype=torch.uint8, count=nbytes, offset=slot.offset)

    def advise(self, slot: Extent, nbytes: int) -> None:
        """Start reading the extent into the page cache (``MADV_WILLNEED``); returns at once."""
        mapped = self._mapped(slot)
        start, end = page_span(slot.offset, slot.offset + nbytes)
        advise_willneed(mapped.mm, start, min(end, mapped.size) - start)

    def cached_bytes(self) -> int:
        """Bytes of this tier's files in the page cache now."""
        with self._maps_lock:
            maps = list(self._maps.values())
        total = 0
        for mapped in maps:
            try:
                total += resident_bytes(mapped.address, mapped.size)
            except OSError as err:  # a statistic only: a file that cannot be asked counts as uncached
                log.debug("mincore of %d bytes failed: %s", mapped.size, err)
        return total

    def sync(self) -> None:
        """Write every dirty page back to the files (``msync``)."""
        with self._maps_lock:
            maps = list(self._maps.values())
        for mapped in maps:
            mapped.mm.flush()

    def close(self) -> None:
        self._workers.close()  # runs what is queued first: no completion is left pending
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), {}
            self._recent.clear()
        for mapped in maps:
            mapped.close()
        self.close_checkpoint()
        self.files.close()
        self.engine.close()

    # -- internals --------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None], priority: int) -> Pending:
        done = Pending()
        box = [fn]  # (emptied before the completion: the waiter may reuse the buffers fn views at once)

        def run() -> None:
            started = time.perf_counter()
            error = None
            try:
                box.pop()()
            except BaseException as err:  # never leave a completion pending
                error = err
            finally:
                with self._lock:
                    self.busy_seconds += time.perf_counter() - started
            done._finish(error)

        self._workers.submit(priority, run)
        return done

    def _mapped(self, slot: Extent) -> _Mapped:
        path = slot.file.path
        with self._maps_lock:
            mapped = self._maps.get(path)
            if mapped is None:
                size = self.files.file_size_of(slot.file)
                self._check_size(slot, None, "map", slot.length, fd=slot.file.buffered_fd, expected=size)
                mapped = self._maps[path] = _Mapped(slot.file.buffered_fd, size)
            return mapped

    @staticmethod
    def _check_size(slot: Extent, mapped: _Mapped | None, op: str, nbytes: int, *, fd: int | None = None,
                    expected: int | None = None) -> None:
        """Refuse to touch bytes past the file's end: through a mapping that is SIGBUS."""
        fd = fd if fd is not None else mapped.fd
        need = expected if expected is not None else slot.offset + nbytes
        size = os.fstat(fd).st_size
        if size < need:
            raise OffloadIOError("read" if op != "write" else "write", slot.file.path, slot.offset, nbytes, None,
                                 f"the file is {size} bytes, {need} expected: was it truncated? (checked "
                                 "before touching its mapping)")

    def _touched(self, slot: Extent, *, dirty: bool) -> None:
        """Count the extent as held in the page cache; drop the least recently used past
        ``cache_limit``."""
        drop = []
        with self._maps_lock:
            key = (slot.file.path, slot.offset)
            entry = self._recent.pop(key, None)
            if entry is None:
                entry = [slot, False]
                self._recent_bytes += slot.length
            entry[1] = entry[1] or dirty
            self._recent[key] = entry
            while self._recent_bytes > self.cache_limit and len(self._recent) > 1:
                _, (old, old_dirty) = self._recent.popitem(last=False)
                self._recent_bytes -= old.length
                mapped = self._maps.get(old.file.path)
                if mapped is not None:
                    drop.append((mapped, old, old_dirty))
        for mapped, old, old_dirty in drop:
            self._drop(mapped, old, old_dirty)

    def _drop(self, mapped: _Mapped, extent: Extent, dirty: bool) -> None:
        start, end = page_span(extent.offset, extent.offset + extent.length)
        self.dropped_bytes += drop_pages(mapped.mm, mapped.fd, start, min(end, mapped.size) - start, dirty=dirty)


class _PriorityWorkers:
    """Threads that run submitted jobs lowest ``priority`` first, in order of arrival
    within a priority. ``close()`` runs what is queued, then stops the threads."""

    _STOP = float("inf")  # after every job

    def __init__(self, threads: int, *, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, job: Callable[[], None]) -> None:
        """Queue ``job`` (which must not raise: it completes its own handle)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the mmap tier is closed")
            self._queue.put((priority, next(self._seq), job))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put((self._STOP, next(self._seq), None))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()[2]) is not None:
            job()
            job = None  # (a done job's closure holds views of its buffers: the pool would not reuse them)
