"""Reading offloaded activations back: ahead of backward, newest first, within a window;
on demand when backward needs one; as a copy for a read outside backward."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from ..io import round_up
from ..store import TensorStore, Tier
from ._saved import SavedRecord, SavedState

__all__ = ["ReadBack", "ActivationCounts", "ActivationOffloadError", "note_stall"]


class ActivationOffloadError(RuntimeError):
    """Saved activations could not be moved to their tier or back (budget, disk)."""


@dataclass
class ActivationCounts:
    """Cumulative and current figures (``offload.stats``' ``act_*`` keys)."""

    written_bytes: int = 0  # moved to the tier
    read_bytes: int = 0  # read back for backward
    stall_seconds: float = 0.0  # compute waiting: copies into write buffers, reads not yet done
    small_bytes: int = 0  # saved tensors under activation_min_bytes, left in place
    held_bytes: int = 0  # in place and restored, now (compute-device memory)
    window_bytes: int = 0  # pieces read ahead and not yet consumed (compute-device memory)
    peak_bytes: int = 0  # the most of held + window since the last reset
    offloaded_bytes: int = 0  # resting on the tier now
    records: int = 0  # storages saved and not yet released

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + self.window_bytes)


def note_stall(counts: ActivationCounts, store: TensorStore, what: str, started: float) -> None:
    """Compute waited for activations from ``started`` until now: counted, and a span of the
    trace when one is recorded (the store's transfers are spans there already)."""
    now = time.perf_counter()
    counts.stall_seconds += now - started
    if store.tracer is not None:
        store.tracer.span(f"activations: {what}", "stall", started, now, "compute")


class ReadBack:
    """The offloaded records of one offloader, in the order saved, and the read-ahead window."""

    def __init__(self, store: TensorStore, device: torch.device, prefetch: int, counts: ActivationCounts):
        self.store, self.device, self.prefetch, self.counts = store, device, prefetch, counts
        self._records: list[SavedRecord] = []  # OFFLOADED (and some consumed since), by seq

    def add(self, record: SavedRecord) -> None:
        bisect.insort(self._records, record, key=lambda r: r.seq)

    def prune(self) -> None:
        self._records = [r for r in self._records if r.state is SavedState.OFFLOADED]

    def ahead(self, below: int | None) -> None:
        """Fetch pieces of records saved before ``below`` (None: all), newest first, while the
        window has room; stop at a record still being written."""
        try:
            self._ahead(below)
        finally:
            self.counts.hold(0)  # (the peak with the window)

    def _ahead(self, below: int | None) -> None:
        records = self._records
        end = len(records) if below is None else bisect.bisect_left(records, below, key=lambda r: r.seq)
        for record in reversed(records[:end]):
            if record.state is not SavedState.OFFLOADED or record.error is not None:
                continue
            if record.being_written:
                break
            for i, (_, size) in enumerate(record.chunks):
                if i in record.fetched:
                    continue
                if self.counts.window_bytes + _slot(size) > self.prefetch:
                    return
                self.store.fetch(record.key(i), Tier.DEVICE, priority=1)
                record.fetched.add(i)
                self.counts.window_bytes += _slot(size)

    def wait_written(self, record: SavedRecord) -> None:
        """Until the writer has put every piece of ``record`` (raises why one failed)."""
        if record.being_written:
            started = time.perf_counter()
            record.written.wait()
            note_stall(self.counts, self.store, "wait for a write", started)
        if record.error is not None:
            raise ActivationOffloadError(f"saving activations failed: {record.error}") from record.error

    def restore(self, record: SavedRecord) -> None:
        """An OFFLOADED record read into a buffer of its own (RESTORED); its pieces deleted."""
        self.wait_written(record)
        self.counts.hold(record.nbytes)  # (counted from the allocation on)
        try:
            whole = self._read(record, keep=False)
        except BaseException:
            self.counts.held_bytes -= record.nbytes
            raise
        record.whole, record.restored_version = whole, whole._version
        record.move(SavedState.RESTORED)
        self.counts.offloaded_bytes -= record.nbytes

    def copy_of(self, record: SavedRecord) -> torch.Tensor:
        """A copy of an OFFLOADED record's bytes; the record stays OFFLOADED."""
        self.wait_written(record)
        return self._read(record, keep=True)

    def drop(self, record: SavedRecord) -> None:
        """Delete an OFFLOADED record's pieces (after its writes: never waits on a foreign thread's
        behalf, the offloader parks records still being written)."""
        if not self.store.closed:
            for i in range(len(record.chunks)):
                self._delete(record, i)
        self.counts.offloaded_bytes -= record.nbytes

    def _read(self, record: SavedRecord, *, keep: bool) -> torch.Tensor:
        whole = torch.empty(record.nbytes, dtype=torch.uint8, device=self.device)
        for i, (at, size) in enumerate(record.chunks):
            if i not in record.fetched:
                self._room_for(record, _slot(size))
            started = time.perf_counter()
            piece = self.store.wait(record.key(i), Tier.DEVICE)
            note_stall(self.counts, self.store, "read back", started)
            whole[at: at + size].copy_(piece)
            if not keep:
                self._delete(record, i)
            elif i not in record.fetched:
                self.store.evict(record.key(i), Tier.DEVICE)  # (read for this copy only)
        self.counts.read_bytes += record.nbytes
        return whole

    def _room_for(self, record: SavedRecord, need: int) -> None:
        """A piece read on demand takes the room beside the window (the tier holds the window
        and one piece). Where backward asks for records out of the order they were saved
        (Mamba's scan), pieces read ahead for later can fill that room too: those of the
        oldest records (wanted last) give it back, and are read again when their turn comes."""
        device = self.store.tiers[Tier.DEVICE]
        for other in self._records:
            if device.used_bytes + need <= device.budget:
                return
            if other is record or not other.fetched:
                continue
            for j in sorted(other.fetched):
                self.store.evict(other.key(j), Tier.DEVICE)  # (one still loading goes when it lands)
                self.counts.window_bytes -= _slot(other.chunks[j][1])
            other.fetched.clear()

    def _delete(self, record: SavedRecord, i: int) -> None:
        self.store.delete(record.key(i))
        if i in record.fetched:
            record.fetched.discard(i)
            self.counts.window_bytes -= _slot(record.chunks[i][1])


def _slot(size: int) -> int:
    """What a piece takes of the DEVICE tier's budget (slots are rounded: pages on the CPU)."""
    return round_up(size, 4096)
