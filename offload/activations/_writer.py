"""Writing saved activations from accelerator memory without holding compute up: each piece
is copied into a pinned host buffer on a copy stream of its own (after an event of the compute
stream, so it reads what the forward wrote), and a thread of ours puts it into the store once
that copy has landed. The source's memory is recorded on the copy stream, so torch's caching
allocator does not hand it to another tensor before the copy has read it.

Two pinned buffers of a piece each: a forward that saves faster than the disk writes waits
for one (the offloader counts that as stall).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

from ..accel import Accelerator
from ..io import BufferPool, HostBuffer
from ..store import TensorStore, Tier
from ._saved import SavedRecord

__all__ = ["DeviceWriter", "COPY_BUFFERS"]

COPY_BUFFERS = 2  # pinned buffers of one piece each


@dataclass(frozen=True)
class _Piece:
    record: SavedRecord
    index: int
    size: int
    buffer: HostBuffer
    copied: Any  # the copy stream's event after this piece's copy


class DeviceWriter:
    """Asynchronous writes of records' pieces from device memory (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, store: TensorStore, home: Tier, chunk: int):
        self.acc, self.store, self.home = accelerator, store, home
        self.stream = accelerator.stream()
        self.pool = BufferPool(COPY_BUFFERS * chunk, pin=accelerator, name="activation copies")
        self._queue: queue.Queue[_Piece | None] = queue.Queue()
        self._lock = threading.Lock()  # records' pending counts (this thread and the writer's)
        self.failed: BaseException | None = None  # the first piece that could not be put: raised at the next save
        self._thread = threading.Thread(target=self._run, name="offload-activation-writer", daemon=True)
        self._thread.start()

    def write(self, record: SavedRecord) -> None:
        """Start writing ``record``'s pieces (``record.chunks``); ``record.written`` is set
        once every piece is in the store (or ``record.error`` says why not)."""
        acc = self.acc
        # one count for this call, one per piece queued: written is set when all are done,
        # also when this call stops half way (an interrupt) after queuing some
        record.written, record.pending, record.error = threading.Event(), 1, None
        queued = 0
        try:
            ready = acc.event()
            ready.record(acc.current_stream())
            for i, (at, size) in enumerate(record.chunks):
                buffer = self.pool.acquire(size)  # (waits for the writer thread to free one)
                try:
                    with acc.using(self.stream):
                        self.stream.wait_event(ready)
                        acc.copy(buffer.bytes[:size], record.whole[at: at + size])
                        copied = acc.event()
                        copied.record(self.stream)
                except BaseException:
                    self.pool.release(buffer)
                    raise
                with self._lock:
                    record.pending += 1
                self._queue.put(_Piece(record, i, size, buffer, copied))
                queued += 1
        except BaseException as err:
            record.error = err  # (the pieces queued are not put; the caller undoes the rest)
            raise
        finally:
            if queued:  # the memory is not handed to another tensor before the copies read it
                acc.record_stream(record.whole, self.stream)
            self._done(record)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.pool.close()

    def _run(self) -> None:
        while True:
            piece = self._queue.get()
            if piece is None:
                return
            record = piece.record
            try:
                piece.copied.synchronize()
                if record.error is None and not self.store.closed:
                    self.store.put(record.key(piece.index), piece.buffer.bytes[: piece.size], self.home)
            except BaseException as err:  # noqa: BLE001 - reported at the next save and where it is read
                record.error = err
                if self.failed is None:
                    self.failed = err
            finally:
                self.pool.release(piece.buffer)
                self._done(record)

    def _done(self, record: SavedRecord) -> None:
        with self._lock:
            record.pending -= 1
            last = record.pending == 0
        if last:
            record.written.set()
