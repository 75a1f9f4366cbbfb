"""The tiers behind one small interface: allocate, free, read_into, write_from.

A tier holds *slots* of bytes under a byte budget. ``read_into`` copies a slot's bytes
into host memory, ``write_from`` copies host memory into a slot; both return a
completion at once (``done()``, ``wait()``, ``exception()``, ``add_done_callback()``).
A tier whose slots are host memory (``addressable``) also hands out ``tensor(slot)``,
so another tier can read straight into it: that is how an NVMe read lands in the
buffer compute will use on a CPU device, with no extra copy.
"""

from __future__ import annotations

import abc
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._tensors import lasting
from ..accel import Accelerator, Event
from ..io import BufferPool, FileEngine, HostBuffer, round_up
from ._completion import Completion, Done, Pending
from ._inplace import CheckpointFiles, CheckpointSlot
from ._nvme import Extent, SwapFiles
from ._state import StoreError, Tier

__all__ = ["Completion", "Done", "Pending", "TierBackend", "HostMemoryTier", "DeviceTier", "SwapFileSlots", "NvmeTier"]


class TierBackend(abc.ABC):
    """Base of every tier: byte accounting against a budget."""

    tier: Tier
    addressable = False  # slots are host memory that tensor(slot) exposes

    def __init__(self, tier: Tier, budget: int):
        self.tier, self.budget = tier, budget
        self.used_bytes = 0
        self.peak_bytes = 0
        self.read_bytes = 0  # bytes copied out of this tier
        self.write_bytes = 0  # bytes copied into this tier
        self._lock = threading.Lock()

    # -- the interface ---------------------------------------------------------------------
    @abc.abstractmethod
    def allocate(self, nbytes: int) -> Any | None:
        """A slot of ``nbytes``, or ``None`` when the budget is full right now."""

    @abc.abstractmethod
    def free(self, slot: Any) -> None:
        """Give the slot's bytes back to the budget."""

    def tensor(self, slot: Any) -> torch.Tensor:
        """The slot's bytes as a uint8 tensor (addressable and device tiers only)."""
        raise TypeError(f"the {self.tier.value} tier has no tensor view of its slots")

    @abc.abstractmethod
    def read_into(self, slot: Any, dest: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        """Copy the slot's first ``nbytes`` into host memory ``dest`` (uint8)."""

    @abc.abstractmethod
    def write_from(self, slot: Any, src: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        """Copy ``nbytes`` of host memory ``src`` (uint8) into the slot."""

    def slot_size(self, nbytes: int) -> int:
        """Bytes of budget a slot for ``nbytes`` takes."""
        return nbytes

    def limit_slack(self, nbytes: int) -> None:
        """Hold at most ``nbytes`` beyond the slot sizes asked for (a tier whose slots may be
        larger than asked: reused pool buffers); what was sized from ``slot_size`` must fit."""

    def fence(self, slot: Any) -> None:
        """The caller is done writing the slot on its stream; later reads must wait for that."""

    def consume(self, slot: Any) -> None:
        """The caller is about to use the slot on its stream; make that stream wait for it."""

    def close(self) -> None:
        pass

    # -- accounting helpers ----------------------------------------------------------------
    def _claim(self, size: int) -> bool:
        with self._lock:
            if self.used_bytes + size > self.budget:
                return False
            self.used_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return True

    def _unclaim(self, size: int) -> None:
        with self._lock:
            self.used_bytes -= size

    def _count(self, *, read: int = 0, write: int = 0) -> None:
        with self._lock:
            self.read_bytes += read
            self.write_bytes += write


# ---------------------------------------------------------------------------------------
class HostMemoryTier(TierBackend):
    """Slots are page-aligned host buffers from a pool (pinned on CUDA).

    Serves the HOST tier, and the DEVICE tier when compute runs in host memory (the CPU).
    """

    addressable = True
    SLOT_ALIGN = 4096  # pool buffers are whole pages

    def __init__(self, tier: Tier, pool: BufferPool):
        super().__init__(tier, pool.budget)
        self.pool = pool

    def slot_size(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1), self.SLOT_ALIGN)

    def limit_slack(self, nbytes: int) -> None:
        self.pool.max_inflation = max(0, nbytes)

    def allocate(self, nbytes: int) -> HostBuffer | None:
        buf = self.pool.try_acquire(nbytes)
        if buf is not None:
            self._claim_unchecked(buf.nbytes)
        return buf

    def free(self, slot: HostBuffer) -> None:
        self._unclaim(slot.nbytes)
        self.pool.release(slot)

    def tensor(self, slot: HostBuffer) -> torch.Tensor:
        return slot.bytes

    def read_into(self, slot: HostBuffer, dest: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        dest[:nbytes].copy_(slot.bytes[:nbytes])
        self._count(read=nbytes)
        return Done()

    def write_from(self, slot: HostBuffer, src: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        slot.bytes[:nbytes].copy_(src[:nbytes])
        self._count(write=nbytes)
        return Done()

    def _claim_unchecked(self, size: int) -> None:
        # the pool already enforced the budget (it also counts its cached buffers)
        with self._lock:
            self.used_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def close(self) -> None:
        self.pool.close()


# ---------------------------------------------------------------------------------------
class _EventWatcher:
    """One thread that turns device events into completion callbacks."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="offload-device-events", daemon=True)
        self._thread.start()

    def watch(self, event: Event, fn: Callable[[], None]) -> None:
        self._queue.put((event, fn))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, fn = item
            event.synchronize()
            fn()


class _EventCompletion(Pending):
    """Completion of an asynchronous device copy, finished by the event watcher thread."""

    def __init__(self, event: Event, watcher: _EventWatcher):
        super().__init__()
        self.event = event
        watcher.watch(event, self._finish)


@dataclass(eq=False)
class _DeviceSlot:
    data: torch.Tensor  # uint8 in the device's memory
    ready: Event | None = None  # the last copy into it
    fenced: Event | None = None  # the caller's last use of it


class DeviceTier(TierBackend):
    """Slots are uint8 tensors in an accelerator's memory (``offload.accel``: CUDA).

    Note: streams. Host-to-device copies run on ``h2d_stream`` and device-to-host copies
    on ``d2h_stream``; each records an event. A consumer makes its own stream wait on
    the slot's ``ready`` event (``consume``) instead of synchronizing the device, and a
    device-to-host copy waits on the ``fenced`` event of the caller's last use. Slots are
    allocated while ``h2d_stream`` is current and ``record_stream`` is called for each
    consumer stream, so the allocator does not hand a freed slot to the next copy while
    compute kernels or a device-to-host copy may still read it.
    """

    SLOT_ALIGN = 512

    def __init__(self, accelerator: Accelerator, budget: int):
        super().__init__(Tier.DEVICE, budget)
        self.accelerator = accelerator
        self.device = accelerator.device
        self.h2d_stream = accelerator.stream()
        self.d2h_stream = accelerator.stream()
        self._watcher = _EventWatcher()

    def slot_size(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1), self.SLOT_ALIGN)

    def allocate(self, nbytes: int) -> _DeviceSlot | None:
        size = self.slot_size(nbytes)
        if not self._claim(size):
            return None
        with self.accelerator.using(self.h2d_stream), lasting():
            slot = _DeviceSlot(self.accelerator.empty(size))
        # (its memory may be a freed slot's whose copy in still runs on h2d_stream: a stream
        # other than h2d_stream that uses it first, a gather into it, waits for that work)
        slot.ready = self.accelerator.event()
        slot.ready.record(self.h2d_stream)
        return slot

    def free(self, slot: _DeviceSlot) -> None:
        self._unclaim(slot.data.numel())
        self.accelerator.release(slot.data)

    def tensor(self, slot: _DeviceSlot) -> torch.Tensor:
        return slot.data

    def fence(self, slot: _DeviceSlot) -> None:
        slot.fenced = self.accelerator.event()
        slot.fenced.record(self.accelerator.current_stream())

    def consume(self, slot: _DeviceSlot) -> None:
        stream = self.accelerator.current_stream()
        if slot.ready is not None:
            stream.wait_event(slot.ready)
        self.accelerator.record_stream(slot.data, stream)

    def read_into(self, slot: _DeviceSlot, dest: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        acc = self.accelerator
        with acc.using(self.d2h_stream):
            if slot.fenced is not None:
                self.d2h_stream.wait_event(slot.fenced)
            acc.copy(dest[:nbytes], slot.data[:nbytes])
            event = acc.event()
            event.record(self.d2h_stream)
        acc.record_stream(slot.data, self.d2h_stream)
        self._count(read=nbytes)
        return _EventCompletion(event, self._watcher)

    def write_from(self, slot: _DeviceSlot, src: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        acc = self.accelerator
        with acc.using(self.h2d_stream):
            if slot.fenced is not None:  # the previous contents may still be in use
                self.h2d_stream.wait_event(slot.fenced)
            acc.copy(slot.data[:nbytes], src[:nbytes])
            event = acc.event()
            event.record(self.h2d_stream)
        slot.ready = event
        self._count(write=nbytes)
        return _EventCompletion(event, self._watcher)

    def close(self) -> None:
        self._watcher.close()


# ---------------------------------------------------------------------------------------
class SwapFileSlots(TierBackend):
    """Slots are extents of ``self.files`` (a SwapFiles): what both NVMe backends share;
    and read-only slots in checkpoint files (``CheckpointSlot``, read through
    ``self.checkpoint``), which cost no budget and are never written."""

    files: SwapFiles
    _checkpoint: CheckpointFiles | None = None

    @property
    def checkpoint(self) -> CheckpointFiles:
        if self._checkpoint is None:
            self._checkpoint = CheckpointFiles(**self.checkpoint_settings())
        return self._checkpoint

    def checkpoint_settings(self) -> dict:
        """The checkpoint engine's settings: the swap engine's block size and system calls
        (a test's faulty ones too); threads and O_DIRECT of its own where the swap engine
        has none to give (the mmap backend's)."""
        return dict(block_size=self.engine.block_size, backend=self.engine.backend)

    @property
    def opened_checkpoint(self) -> CheckpointFiles | None:
        """The checkpoint files, once one was opened (None before)."""
        return self._checkpoint

    def read_checkpoint(self, slot: CheckpointSlot, dest: torch.Tensor, nbytes: int, priority: int) -> Completion:
        self._count(read=nbytes)
        return self.checkpoint.read(slot, dest, nbytes, priority=priority)

    @staticmethod
    def refuse_write(slot: CheckpointSlot) -> None:
        raise StoreError(f"a write into a checkpoint read in place ({slot.ranges[0].file.path!r}): the store moves "
                         "such a tensor to a swap extent before its first write; this is a bug in offload, please "
                         "report it")

    def close_checkpoint(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint.close()

    def slot_size(self, nbytes: int) -> int:
        return self.files.extent_size(nbytes)

    def allocate(self, nbytes: int) -> Extent | None:
        size = self.slot_size(nbytes)
        if not self._claim(size):
            return None
        try:
            return self.files.allocate(size)
        except BaseException:
            self._unclaim(size)
            raise

    def free(self, slot: Extent | CheckpointSlot) -> None:
        if isinstance(slot, CheckpointSlot):  # (it claimed nothing)
            return
        self.files.free(slot)
        self._unclaim(slot.length)


class NvmeTier(SwapFileSlots):
    """Slots are extents of a few large preallocated files, moved by the file engine."""

    def __init__(self, files: SwapFiles, engine: FileEngine, budget: int | None = None):
        super().__init__(Tier.NVME, budget if budget is not None else 1 << 62)
        self.files, self.engine = files, engine

    def checkpoint_settings(self) -> dict:
        e = self.engine
        return dict(super().checkpoint_settings(), threads=e.threads, queue_depth=e.queue_depth, direct=e.direct)

    def read_into(self, slot: Extent | CheckpointSlot, dest: torch.Tensor, nbytes: int, *,
                  priority: int = 1) -> Completion:
        if isinstance(slot, CheckpointSlot):
            return self.read_checkpoint(slot, dest, nbytes, priority)
        handle = self.engine.read(slot.file, slot.offset, dest, self._io_length(dest, nbytes, slot),
                                  priority=priority)
        self._count(read=nbytes)
        return handle

    def write_from(self, slot: Extent, src: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        if isinstance(slot, CheckpointSlot):
            self.refuse_write(slot)
        handle = self.engine.write(slot.file, slot.offset, src, self._io_length(src, nbytes, slot),
                                   priority=priority)
        self._count(write=nbytes)
        return handle

    @staticmethod
    def _io_length(buffer: torch.Tensor, nbytes: int, slot: Extent) -> int:
        # Round the transfer up to the extent's aligned length when the host buffer has the
        # room (pool buffers do), so the whole transfer can go O_DIRECT with no tail.
        return slot.length if buffer.numel() >= slot.length else nbytes

    @property
    def busy_seconds(self) -> float:
        """Seconds the file engine's workers spent inside system calls."""
        return self.engine.stats.busy_seconds

    def cached_bytes(self) -> int:
        """Bytes of the swap files in the page cache (direct I/O leaves few there)."""
        return self.files.cached_bytes()

    def close(self) -> None:
        self.close_checkpoint()
        self.files.close()
        self.engine.close()
