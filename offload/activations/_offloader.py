"""The activation offloader: what a wrapped model's forward saves for backward, kept in place
up to a budget (the most recent), moved to a tier of its own store beyond it, read back
ahead of backward in the reverse of the order it was saved (``_reader``), released when
autograd drops it.

Called from the model's ``saved_tensors_hooks`` (``offload.params``' ModuleHooks): ``pack``
when an operation saves a tensor, ``unpack`` when backward (or a ``grad_fn._saved_*`` read)
needs it. A saved tensor's handle dies with the autograd node that holds it, whether backward
ran, the graph was freed unused, or a forward raised half way; its record is released when
its last handle is gone.

Note: where releases run. A handle may die on any thread (a garbage collection on the
writer's thread or an I/O worker's). Its death is only queued; the queue is worked off on the
threads that run the model (each pack and unpack, the end of each backward, the next
forward, ``stats``), and a record whose pieces are still being written is parked until they
are, so no release ever waits on the thread it runs on.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from typing import Any, Iterator

import torch

from .._autograd import graph_task, in_backward, queue_end_of_backward
from ..store import BudgetError, TensorStore, Tier
from ._reader import ActivationCounts, ActivationOffloadError, ReadBack, note_stall
from ._saved import ModifiedSavedTensorError, SavedHandle, SavedRecord, SavedSource, SavedState, kept
from ._writer import DeviceWriter

__all__ = ["ActivationOffloader", "CHUNK_BYTES", "on_device", "figures"]

CHUNK_BYTES = 16 << 20  # a saved tensor moves in pieces of at most this (windows stay small)


def figures(c: ActivationCounts, pools: list) -> dict[str, Any]:
    """``offload.stats``' ``act_*`` keys from an offloader's counts and its buffer pools."""
    return {"act_written_bytes": c.written_bytes, "act_read_bytes": c.read_bytes,
            "act_stall_seconds": c.stall_seconds, "act_small_bytes": c.small_bytes,
            "act_held_bytes": c.held_bytes, "act_peak_bytes": c.peak_bytes,
            "act_offloaded_bytes": c.offloaded_bytes, "act_records": c.records,
            "act_buffer_bytes": sum(p.held_bytes for p in pools),
            "act_buffer_peak_bytes": sum(p.peak_bytes for p in pools)}


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device`` (``cuda`` without an index: the current one)."""
    here = tensor.device
    if here.type != device.type:
        return False
    if device.index is None and here.type == "cuda":
        return here.index == torch.cuda.current_device()
    return device.index is None or here.index == device.index


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
        self.budget, self.min_bytes, self.chunk = budget, max(min_bytes, 1), chunk
        self.counts = ActivationCounts()
        self.reader = ReadBack(store, self.device, prefetch, self.counts)
        self._mutex = threading.Lock()
        self._dropped: collections.deque[SavedRecord] = collections.deque()
        self._parked: list[SavedRecord] = []  # released while their pieces were being written
        self._seq = 0
        self._by_storage: dict[int, SavedRecord] = {}  # IN_PLACE and OFFLOADED records by storage address
        self._in_place: collections.OrderedDict[int, SavedRecord] = collections.OrderedDict()
        self._in_place_bytes = 0
        self._skip: set[int] = set()  # storages of the model's own tensors (parameters, buffers)
        self._end_task: int | None = None  # the backward whose end will work off the releases
        self._closed = False

    # -- the model's passes ---------------------------------------------------------------------
    def begin_forward(self, model_storages: set[int]) -> None:
        """A root forward with grad starts; ``model_storages``: addresses never to offload."""
        with self._locked():
            self._skip = model_storages
            self.reader.prune()

    def settle(self) -> None:
        """Work off the releases queued since the last call (see the module's note)."""
        if not self._closed:
            with self._locked():
                pass

    def end_forward(self) -> None:
        """The forward is done: start reading the newest offloaded activations back."""
        with self._locked():
            self._raise_write_error()
            self.reader.ahead(None)

    # -- saved tensors ----------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """What autograd keeps for ``tensor``: a handle, or the tensor itself (``kept``, detached) if it stays."""
        if (type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.is_nested
                or tensor.is_quantized or tensor.is_conj() or tensor.is_neg() or not on_device(tensor, self.device)
                or self._closed):
            return kept(tensor.detach())
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes:
            self.counts.small_bytes += nbytes
            return kept(tensor.detach())
        ptr = storage.data_ptr()
        if ptr in self._skip:
            return kept(tensor.detach())
        with self._locked():
            self._raise_write_error()
            record = self._by_storage.get(ptr)
            if record is not None and not self._same_bytes(record, storage, nbytes):
                record = None
            if record is None:
                whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (nbytes,), (1,))
                record = SavedRecord(self._seq, nbytes, ptr, weakref.ref(storage), whole)
            source = SavedSource(tensor)
            handle = SavedHandle(self, record, source, tensor)  # (before any state changes: it may raise)
            if record.seq == self._seq:  # a new record
                self._seq += 1
                self._by_storage[ptr] = record
                self._in_place[record.seq] = record
                self._in_place_bytes += nbytes
                self.counts.hold(nbytes)
                self.counts.records += 1
            record.handles += 1
            record.sources.append(source)
            if record.state is not SavedState.IN_PLACE:  # its bytes are written: holding the tensor would keep
                source.let_go()  # its memory alive beside the copy backward reads back
            while self._in_place_bytes > self.budget and self._in_place:
                self._offload(self._in_place.popitem(last=False)[1])
        return handle

    def unpack(self, handle: SavedHandle) -> torch.Tensor:
        record, source = handle.record, handle.source
        with self._locked():
            if self._closed:
                raise ActivationOffloadError("a backward read activations of a model that was closed (offload.close "
                                             "or unwrap) while its graph was alive: run backward before closing")
            source.check()
            if in_backward():
                self._queue_end_of_backward()
            if record.state is SavedState.IN_PLACE:
                return source.held  # what autograd would have kept: the same tensor, the same version
            if record.state is SavedState.RELEASED:
                raise RuntimeError("a saved activation was read after its release (a bug in offload, please "
                                   "report it)")
            if not in_backward():  # grad_fn._saved_* read: a copy; the record stays where it is
                whole = record.whole if record.state is SavedState.RESTORED else self.reader.copy_of(record)
                return handle.view(whole).clone()
            if record.state is SavedState.OFFLOADED:
                self.reader.restore(record)
                if self._by_storage.get(record.ptr) is record:
                    del self._by_storage[record.ptr]
            elif record.whole._version != record.restored_version:
                raise ModifiedSavedTensorError(
                    "one of the variables needed for gradient computation has been modified by an inplace operation: "
                    "a saved activation read back for backward was changed in place by an earlier read's user (a "
                    "custom backward, or a backward through the graph before with retain_graph=True); change a copy")
            self.reader.ahead(record.seq)
            return handle.view(record.whole)

    def handle_dropped(self, record: SavedRecord) -> None:
        """A handle died (autograd freed the node holding it): queued, see the module's note."""
        if not self._closed:
            self._dropped.append(record)

    # -- reports --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        self.settle()
        return figures(self.counts, [self.store.staging] + ([self.writer.pool] if self.writer is not None else []))

    def reset_peaks(self) -> None:
        self.counts.peak_bytes = self.counts.held_bytes + self.counts.window_bytes
        self.store.staging.reset_peak()
        if self.writer is not None:
            self.writer.pool.reset_peak()

    def close(self) -> None:
        """Release every record's bytes and the store (files, threads, buffers)."""
        with self._locked():
            self._closed = True
            self._dropped.clear()
            for record in list(self._in_place.values()):
                record.whole = None
                for source in record.sources:
                    source.held = None
            self._by_storage.clear()
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.store.close()

    # -- inside ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex:
            self._drain()  # (what died since: released before this call holds more)
            try:
                yield
            finally:
                self._drain()

    def _drain(self) -> None:
        if self._parked:
            waiting = [r for r in self._parked if r.being_written]
            for record in self._parked:
                if not record.being_written:
                    self._release(record)
            self._parked = waiting
        while self._dropped:
            record = self._dropped.popleft()
            record.handles -= 1
            if record.handles == 0 and record.state is not SavedState.RELEASED:
                if record.state is SavedState.OFFLOADED and record.being_written:
                    self._parked.append(record)
                else:
                    self._release(record)

    def _queue_end_of_backward(self) -> None:
        """At the end of this backward, work off the releases of the nodes it ran (a backward
        that raised drops its callbacks: the next one queues anew)."""
        task = graph_task()
        if task != self._end_task:
            self._end_task = task
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        with self._locked():
            self._end_task = None

    def _same_bytes(self, record: SavedRecord, storage: Any, nbytes: int) -> bool:
        """Whether ``record`` holds this storage's bytes as they are now: the same storage (not a
        new one at a freed one's address), kept in place, or written and not changed since."""
        if record.storage() is not storage or record.nbytes != nbytes:
            return False
        if record.state is SavedState.IN_PLACE:
            return True
        for source in record.sources:
            source.look()
        return record.state is SavedState.OFFLOADED and not any(s.stale for s in record.sources)

    def _raise_write_error(self) -> None:
        if self.writer is not None and self.writer.failed is not None:
            err, self.writer.failed = self.writer.failed, None  # (raised once; its records raise when read)
            hint = (". Raise activation_host_budget, use activation_tier='nvme', or checkpoint the model's layers"
                    if isinstance(err, BudgetError) else "")
            raise ActivationOffloadError(f"saving activations to {self.home.value} failed: {err}{hint}") from err

    def _offload(self, record: SavedRecord) -> None:
        """Write an IN_PLACE record's bytes to the tier and stop holding them."""
        for source in record.sources:
            source.look()
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
            self._undo_offload(record)
            if isinstance(err, BudgetError):
                raise ActivationOffloadError(
                    f"saved activations do not fit: {err}. Raise activation_host_budget (activation_tier="
                    f"{self.home.value!r}), use activation_tier='nvme', or checkpoint the model's layers "
                    "(model.gradient_checkpointing_enable())") from err
            if isinstance(err, Exception):
                raise ActivationOffloadError(f"saving activations to {self.home.value} failed: {err}") from err
            raise
        finally:
            note_stall(self.counts, self.store, "write", started)
        for source in record.sources:
            source.let_go()
        self._in_place_bytes -= n
        self.counts.held_bytes -= n
        record.whole = None
        record.move(SavedState.OFFLOADED)
        self.reader.add(record)
        self.counts.written_bytes += n
        self.counts.offloaded_bytes += n

    def _undo_offload(self, record: SavedRecord) -> None:
        """A write that failed: its pieces gone, the record held in place again (the graph stays whole)."""
        if record.written is not None:
            record.written.wait()  # (pieces already queued: the writer's own thread finishes them)
        for i in range(len(record.chunks)):
            self.store.delete(record.key(i))
        record.chunks, record.written, record.error = [], None, None
        self._in_place[record.seq] = record
        self._in_place.move_to_end(record.seq, last=False)

    def _release(self, record: SavedRecord) -> None:
        if self._by_storage.get(record.ptr) is record:
            del self._by_storage[record.ptr]
        if record.state is SavedState.IN_PLACE:
            self._in_place.pop(record.seq, None)
            self._in_place_bytes -= record.nbytes
            self.counts.held_bytes -= record.nbytes
        elif record.state is SavedState.OFFLOADED:
            self.reader.drop(record)
        elif record.state is SavedState.RESTORED:
            self.counts.held_bytes -= record.nbytes
        record.whole = None
        record.sources = []
        record.move(SavedState.RELEASED)
        self.counts.records -= 1
