"""The activation offloader: what a wrapped model's forward saves for backward, kept in place
up to a budget (the most recent), moved to a tier of its own store beyond it, read back
ahead of backward in the reverse of the order it was saved, released when autograd drops it.

Called from the model's ``saved_tensors_hooks`` (``offload.params``' ModuleHooks): ``pack``
when an operation saves a tensor, ``unpack`` when backward (or a ``grad_fn._saved_*`` read)
needs it. A saved tensor's handle dies with the autograd node that holds it, which is when
its record's bytes are released, whether backward ran, the graph was freed unused, or a
forward raised half way.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..store import BudgetError, TensorStore, Tier
from ._saved import ModifiedSavedTensorError, SavedHandle, SavedRecord, SavedState
from ._writer import DeviceWriter

__all__ = ["ActivationOffloader", "ActivationCounts", "ActivationOffloadError", "CHUNK_BYTES"]

CHUNK_BYTES = 16 << 20  # a saved tensor moves in pieces of at most this (windows stay small)


class ActivationOffloadError(RuntimeError):
    """Saved activations could not be moved to their tier (budget, disk); the forward stops."""


@dataclass
class ActivationCounts:
    """Cumulative and current figures (``offload.stats``' ``act_*`` keys)."""

    written_bytes: int = 0  # moved to the tier
    read_bytes: int = 0  # read back for backward
    stall_seconds: float = 0.0  # compute waiting: copies into write buffers, reads not yet done
    small_bytes: int = 0  # saved tensors under activation_min_bytes, left in place
    held_bytes: int = 0  # in place and restored, now (compute-device memory)
    peak_bytes: int = 0  # the most held plus the read-ahead window's slots, since the last reset
    offloaded_bytes: int = 0  # resting on the tier now
    records: int = 0  # storages saved and not yet released


class ActivationOffloader:
    """Saved activations of one wrapped model (see the module docstring).

    Args:
        store: the activation store: a DEVICE tier for the read-ahead window and ``home``.
        home: the tier offloaded activations rest on (HOST or NVME).
        device: the compute device; saved tensors elsewhere stay where they are.
        budget: bytes kept in place (the most recently saved).
        prefetch: bytes read ahead of backward.
        min_bytes: smaller storages stay in place.
        chunk: the most bytes one stored piece holds.
        writer: on an accelerator, what copies pieces out of device memory asynchronously;
            None: ``store.put`` copies them (host memory: a copy into a staging buffer).
    """

    def __init__(self, store: TensorStore, home: Tier, *, device: torch.device, budget: int, prefetch: int,
                 min_bytes: int, chunk: int = CHUNK_BYTES, writer: DeviceWriter | None = None):
        self.store, self.home, self.device, self.writer = store, home, torch.device(device), writer
        self.budget, self.prefetch, self.min_bytes, self.chunk = budget, prefetch, max(min_bytes, 1), chunk
        self.counts = ActivationCounts()
        self._mutex = threading.Lock()  # not reentrant: a handle dying inside our own section queues
        self._dropped: collections.deque[SavedRecord] = collections.deque()
        self._seq = 0
        self._by_storage: dict[int, SavedRecord] = {}  # IN_PLACE records by storage address
        self._in_place: collections.OrderedDict[int, SavedRecord] = collections.OrderedDict()
        self._in_place_bytes = 0
        self._offloaded: list[SavedRecord] = []  # in the order offloaded, which is seq order
        self._window = 0  # bytes of chunks fetched ahead and not yet consumed
        self._skip: set[int] = set()  # storages of the model's own tensors (parameters, buffers)
        self._closed = False

    # -- the model's passes ---------------------------------------------------------------------
    def begin_forward(self, model_storages: set[int]) -> None:
        """A root forward with grad starts; ``model_storages``: addresses never to offload."""
        with self._locked():
            self._skip = model_storages
            self._offloaded = [r for r in self._offloaded if r.state is SavedState.OFFLOADED]

    def end_forward(self) -> None:
        """The forward is done: start reading the newest offloaded activations back."""
        with self._locked():
            self._read_ahead(None)

    # -- saved tensors ----------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """What autograd keeps for ``tensor``: a handle, or ``tensor`` itself if it stays."""
        if (type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.device != self.device
                or tensor.is_conj() or tensor.is_neg() or self._closed):
            return tensor
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes:
            self.counts.small_bytes += nbytes
            return tensor
        ptr = storage.data_ptr()
        if ptr in self._skip:
            return tensor
        with self._locked():
            record = self._by_storage.get(ptr)
            if record is None or record.nbytes != nbytes:
                whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,))
                record = SavedRecord(self._seq, nbytes, self.device, ptr, whole)
                self._seq += 1
                self._by_storage[ptr] = record
                self._in_place[record.seq] = record
                self._in_place_bytes += nbytes
                self._hold(nbytes)
                self.counts.records += 1
            record.handles += 1
            # detach() shares the version counter and has no grad_fn: holding it makes no cycle
            record.sources.append((tensor.detach(), tensor._version))
            handle = SavedHandle(self, record, tensor)
            while self._in_place_bytes > self.budget and self._in_place:
                self._offload(self._in_place.popitem(last=False)[1])
        return handle

    def unpack(self, handle: SavedHandle) -> torch.Tensor:
        record = handle.record
        with self._locked():
            reason = record.modified or record.check_versions()
            if reason is not None:
                raise ModifiedSavedTensorError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation ({reason}); offload's activation offload refuses it as torch does. Hint: "
                    "make the operation out of place (e.g. x = x + y instead of x += y)")
            if record.state is SavedState.OFFLOADED:
                self._restore(record)
            elif record.state is SavedState.RELEASED:
                raise RuntimeError("a saved activation was read after its release (a bug in offload, please "
                                   "report it)")
            whole = record.whole
            self._read_ahead(record.seq)
        return handle.view(whole)

    def handle_dropped(self, record: SavedRecord) -> None:
        """A handle died (autograd freed the node holding it): release at zero handles."""
        self._dropped.append(record)
        if self._mutex.acquire(blocking=False):  # else the holder of the mutex drains the queue
            try:
                self._drain()
            finally:
                self._mutex.release()

    # -- reports --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        c = self.counts
        pool = self.store.staging
        return {"act_written_bytes": c.written_bytes, "act_read_bytes": c.read_bytes,
                "act_stall_seconds": c.stall_seconds, "act_small_bytes": c.small_bytes,
                "act_held_bytes": c.held_bytes, "act_peak_bytes": c.peak_bytes,
                "act_offloaded_bytes": c.offloaded_bytes, "act_records": c.records,
                "act_buffer_bytes": pool.held_bytes, "act_buffer_peak_bytes": pool.peak_bytes}

    def reset_peaks(self) -> None:
        self.counts.peak_bytes = self.counts.held_bytes + self._window
        self.store.staging.reset_peak()

    def close(self) -> None:
        """Release every record's bytes and the store (files, threads, buffers)."""
        with self._locked():
            self._closed = True
            for record in list(self._in_place.values()) + self._offloaded:
                record.whole = None
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.store.close()

    # -- inside ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex:
            try:
                yield
            finally:
                self._drain()

    def _drain(self) -> None:
        while self._dropped:
            record = self._dropped.popleft()
            record.handles -= 1
            if record.handles == 0 and record.state is not SavedState.RELEASED:
                self._release(record)

    def _hold(self, nbytes: int) -> None:
        c = self.counts
        c.held_bytes += nbytes
        c.peak_bytes = max(c.peak_bytes, c.held_bytes + self._window)

    def _offload(self, record: SavedRecord) -> None:
        """Write an IN_PLACE record's bytes to the tier and stop holding them."""
        record.modified = record.check_versions()
        sources, record.sources = record.sources, []
        n = record.nbytes
        record.chunks = [(at, min(self.chunk, n - at)) for at in range(0, n, self.chunk)]
        started = time.perf_counter()
        try:
            if self.writer is not None:
                self.writer.write(record)
            else:
                for i, (at, size) in enumerate(record.chunks):
                    self.store.put(record.key(i), record.whole[at: at + size], self.home)
        except BaseException as err:
            if record.written is not None:
                record.written.wait()
            for i in range(len(record.chunks)):
                self.store.delete(record.key(i))
            record.chunks = []
            record.sources = sources
            self._in_place[record.seq] = record  # still held: the graph stays whole
            self._in_place.move_to_end(record.seq, last=False)
            if isinstance(err, BudgetError):
                raise ActivationOffloadError(
                    f"saved activations do not fit: {err}. Raise activation_host_budget (activation_tier="
                    f"{self.home.value!r}), use activation_tier='nvme', or checkpoint the model's layers "
                    "(model.gradient_checkpointing_enable())") from err
            if isinstance(err, Exception):
                raise ActivationOffloadError(f"saving activations to {self.home.value} failed: {err}") from err
            raise
        finally:
            self.counts.stall_seconds += time.perf_counter() - started
        self._by_storage.pop(record.ptr, None)
        self._in_place_bytes -= n
        self.counts.held_bytes -= n
        record.whole = None
        record.move(SavedState.OFFLOADED)
        self._offloaded.append(record)
        self.counts.written_bytes += n
        self.counts.offloaded_bytes += n

    def _wait_written(self, record: SavedRecord) -> None:
        """Until the writer has put every piece of ``record`` (raises why one failed)."""
        if record.written is None:
            return
        if not record.written.is_set():
            started = time.perf_counter()
            record.written.wait()
            self.counts.stall_seconds += time.perf_counter() - started
        if record.error is not None:
            raise ActivationOffloadError(f"saving activations to {self.home.value} failed: {record.error}") \
                from record.error

    def _restore(self, record: SavedRecord) -> None:
        """Read an OFFLOADED record back into a buffer of its own."""
        self._wait_written(record)
        whole = torch.empty(record.nbytes, dtype=torch.uint8, device=self.device)
        for i, (at, size) in enumerate(record.chunks):
            started = time.perf_counter()
            piece = self.store.wait(record.key(i), Tier.DEVICE)
            self.counts.stall_seconds += time.perf_counter() - started
            whole[at: at + size].copy_(piece)
            self._drop_chunk(record, i)
        record.whole = whole
        record.move(SavedState.RESTORED)
        self.counts.read_bytes += record.nbytes
        self.counts.offloaded_bytes -= record.nbytes
        self._hold(record.nbytes)

    def _drop_chunk(self, record: SavedRecord, i: int) -> None:
        self.store.delete(record.key(i))
        if i in record.fetched:
            record.fetched.discard(i)
            self._window -= record.chunks[i][1]

    def _read_ahead(self, below: int | None) -> None:
        """Fetch offloaded chunks saved before ``below`` (None: all), newest first, while the
        window has room."""
        records = self._offloaded
        end = len(records) if below is None else bisect.bisect_left(records, below, key=lambda r: r.seq)
        for record in reversed(records[:end]):
            if record.state is not SavedState.OFFLOADED:
                continue
            if record.written is not None and not record.written.is_set():
                break  # (still being written: read ahead from here at the next read)
            for i, (_, size) in enumerate(record.chunks):
                if i in record.fetched:
                    continue
                if self._window + size > self.prefetch:
                    return
                self.store.fetch(record.key(i), Tier.DEVICE, priority=1)
                record.fetched.add(i)
                self._window += size
        self.counts.peak_bytes = max(self.counts.peak_bytes, self.counts.held_bytes + self._window)

    def _release(self, record: SavedRecord) -> None:
        if record.state is SavedState.IN_PLACE:
            self._in_place.pop(record.seq, None)
            if self._by_storage.get(record.ptr) is record:
                del self._by_storage[record.ptr]
            self._in_place_bytes -= record.nbytes
            self.counts.held_bytes -= record.nbytes
        elif record.state is SavedState.OFFLOADED:
            if record.written is not None:
                record.written.wait()
            if not self.store.closed:
                for i in range(len(record.chunks)):
                    self._drop_chunk(record, i)
            self.counts.offloaded_bytes -= record.nbytes
        elif record.state is SavedState.RESTORED:
            self.counts.held_bytes -= record.nbytes
        record.whole = None
        record.sources = []
        record.move(SavedState.RELEASED)
        self.counts.records -= 1
