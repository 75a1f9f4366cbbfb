"""Tensors read where a checkpoint already holds them: the NVMe tier's read-only slots.

A ``CheckpointSlot`` is a list of byte ranges in checkpoint files (safetensors: one range
per run of neighbouring tensors) and where each lands in the stored tensor's bytes. It is a home that costs
no swap space and was never written: ``TensorStore.adopt`` makes one, and the first
write of the tensor moves it to a swap extent (copy on first write, in
``TensorStore._write_home``).

Note: alignment. O_DIRECT needs the file offset and the memory address to agree modulo
the block size. A safetensors tensor starts at any multiple of its dtype's size, and so
does a range (a run of neighbouring tensors), so a range is read by the file engine as
any request is: the aligned body O_DIRECT, straight into place, and the unaligned head
and tail (under a block each) buffered. That holds
when the range's destination agrees with its file offset modulo the block size, which
is for the caller to arrange (``offload.params`` lays the groups it adopts out so); a
range that does not agree is read buffered in full, through the page cache. A range
with a ``shift`` has the bytes that matter in it (``skip`` and ``kept``) moved that much
down once read: they keep a stronger alignment than their file offset gives them where
they land (safetensors pads its header to 8 bytes, so about half of all files hold every
tensor 8 bytes off a multiple of 16). A file system without O_DIRECT is read buffered
throughout (the engine warns once).

Note: a checkpoint that changes under a running model. Each file's size and
modification time are taken when it is opened and checked before every read of it; a
change raises ``CheckpointChangedError`` naming the file. A file replaced by a rename
(how most writers save) is not a change here: the open descriptor keeps reading the
bytes the model was built from.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .._signals import DEFER
from ..io import EngineFile, FileBackend, FileEngine
from ._completion import Pending
from ._records import StoredTensor
from ._state import Residency, StoreError, Tier

__all__ = ["CheckpointSlot", "CheckpointRange", "CheckpointFiles", "CheckpointChangedError", "InPlaceHomes"]

log = logging.getLogger(__name__)


class CheckpointChangedError(StoreError):
    """A checkpoint file read in place changed (size or modification time) since it was opened."""


@dataclass(frozen=True)
class CheckpointRange:
    """``length`` bytes at ``offset`` of ``file``, landing at ``dest`` of the tensor's bytes.
    With a ``shift``, the ``kept`` bytes from ``skip`` on in the range (to its end when
    None) are then moved that much down, never below the tensor's first byte."""

    file: EngineFile
    offset: int
    length: int
    dest: int
    shift: int = 0
    skip: int = 0
    kept: int | None = None

    def __post_init__(self) -> None:
        if self.shift and self.dest + self.skip < self.shift:
            raise ValueError(f"a range moved {self.shift} bytes down would start before the tensor: "
                             f"dest={self.dest}, skip={self.skip}")

    def moved(self, length: int) -> int:
        """How many bytes are moved down once the range's first ``length`` bytes landed."""
        if not self.shift:
            return 0
        end = length if self.kept is None else min(length, self.skip + self.kept)
        return max(0, end - self.skip)


@dataclass(frozen=True, eq=False)
class CheckpointSlot:
    """A read-only home: the ranges of checkpoint files that make up a tensor's bytes."""

    ranges: tuple[CheckpointRange, ...]
    length: int


@dataclass(frozen=True)
class _Watched:
    file: EngineFile
    size: int
    mtime_ns: int


class _Read(Pending):
    """One slot's read: done when its last range has landed."""

    def __init__(self) -> None:
        super().__init__()
        self.left = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def range_done(self, error: BaseException | None) -> None:
        with self.lock:
            self.error = self.error or error
            self.left -= 1
            last = self.left == 0
        if last:
            self._finish(self.error)


class CheckpointFiles:
    """The checkpoint files a store reads in place: opened read-only by an engine of their
    own and watched for change."""

    def __init__(self, *, threads: int = 16, queue_depth: int = 16, block_size: int = 8 << 20, direct: bool = True,
                 backend: FileBackend | None = None):
        self._settings = dict(threads=threads, queue_depth=queue_depth, block_size=block_size, direct=direct,
                              backend=backend)
        self._engine: FileEngine | None = None
        self._files: dict[str, _Watched] = {}  # by real path
        self._by_file: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self.read_bytes = 0

    def open(self, path: str) -> EngineFile:
        """The engine's read-only handle of ``path`` (opened once per file, however named;
        messages name it as first given)."""
        real = os.path.realpath(path)
        with self._lock:
            watched = self._files.get(real)
            if watched is None:
                if self._engine is None:
                    self._engine = FileEngine(**self._settings, name="offload-checkpoint")
                file = self._engine.open(path, readonly=True)
                st = os.fstat(file.buffered_fd)
                watched = self._files[real] = _Watched(file, st.st_size, st.st_mtime_ns)
                self._by_file[id(file)] = watched
            return watched.file

    @property
    def files(self) -> list[str]:
        return [w.file.path for w in self._files.values()]

    def check(self, file: EngineFile) -> None:
        """Raise ``CheckpointChangedError`` if ``file`` changed since it was opened."""
        watched = self._by_file[id(file)]
        st = os.fstat(file.buffered_fd)
        if (st.st_size, st.st_mtime_ns) == (watched.size, watched.mtime_ns):
            return
        what = (f"its size went from {watched.size} to {st.st_size} bytes" if st.st_size != watched.size
                else "it was modified (its modification time moved)")
        raise CheckpointChangedError(
            f"checkpoint file {file.path!r} changed while the model reads its weights in place: {what}, so the "
            "parameters not yet trained can no longer be read. Save checkpoints elsewhere (offload.save_checkpoint, "
            "or save_pretrained to another directory), or wrap with OffloadConfig(read_in_place=False) to copy the "
            "weights into swap files first")

    def read(self, slot: CheckpointSlot, dest: torch.Tensor, nbytes: int, *, priority: int = 1) -> Pending:
        """Start reading ``slot``'s first ``nbytes`` into host memory ``dest`` (uint8): a
        request per range, straight into place (its kept bytes then moved down by its shift)."""
        for file in {r.file for r in slot.ranges}:
            self.check(file)
        read = _Read()
        pieces = [(r, min(r.length, nbytes - r.dest)) for r in slot.ranges if r.dest < nbytes]
        read.left = len(pieces)
        if not pieces:
            read._finish()
            return read
        address = dest.data_ptr()
        for r, length in pieces:
            try:
                handle = self._engine.read(r.file, r.offset, dest[r.dest: r.dest + length], length, priority=priority)
            except Exception as err:  # (a request that cannot start fails the read like one that did)
                self._landed(read, err, 0)
                continue
            # (the callback holds the address, not ``dest``: it runs on after the read is done,
            # and a view alive then would keep the pool from dropping the buffer once released)
            handle.add_done_callback(lambda h, n=length, to=address + r.dest + r.skip - r.shift, by=r.shift,
                                     m=r.moved(length): self._landed(read, h.exception(), n, to, by, m))
        return read

    @property
    def buffered_read_bytes(self) -> int:
        """Bytes read through the page cache (a small range, a range's unaligned ends, a
        range that does not agree with its file, a file system without O_DIRECT)."""
        return self._engine.stats.buffered_read_bytes if self._engine is not None else 0

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._files.clear()
        self._by_file.clear()

    def _landed(self, read: _Read, error: BaseException | None, nbytes: int, to: int = 0, shift: int = 0,
                moved: int = 0) -> None:
        """``to``: the address ``moved`` bytes belong at (``shift`` bytes below where they were read)."""
        try:
            if error is None:
                if moved:  # (overlapping: memmove, which releases the GIL; on the I/O thread that finished it)
                    ctypes.memmove(to, to + shift, moved)
                with self._lock:
                    self.read_bytes += nbytes
        finally:  # (the read must finish, whatever happened here)
            read.range_done(error)


class InPlaceHomes:
    """The store's tensors whose home is a checkpoint's bytes (part of
    :class:`~offload.store.TensorStore`, a mixin like ``Lending``)."""

    moved_bytes = 0  # tensors written once and so moved to a swap extent

    def open_checkpoint(self, path: str) -> EngineFile:
        """A read-only handle of checkpoint file ``path``, for the ranges of ``adopt``."""
        with DEFER, self._cond:
            self._check_open()
            return self._backend(Tier.NVME).checkpoint.open(path)

    def adopt(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], ranges: list[CheckpointRange]) -> StoredTensor:
        """Store ``key`` with its home in the NVMe tier where ``ranges`` already hold its
        bytes: nothing is copied or written, and no NVMe budget is taken until its first
        write moves it to a swap extent."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        for r in ranges:  # (a range past the tensor's end would be read short, and its moved bytes wrong)
            if r.offset < 0 or r.dest < 0 or r.dest + r.length > nbytes:
                raise ValueError(f"adopt({key!r}): a range of {r.length} bytes at {r.dest} does not fit the "
                                 f"tensor's {nbytes} bytes (file offset {r.offset})")
        with DEFER, self._cond:
            self._check_open()
            self._backend(Tier.NVME)
            if key in self._tensors:
                self._delete(self._tensors[key])
            record = StoredTensor(key, dtype, tuple(shape), nbytes, Tier.NVME)
            copy = record.copy(Tier.NVME)
            copy.slot = CheckpointSlot(tuple(ranges), nbytes)
            self._tensors[key] = record
            self._move(record, copy, Residency.RESIDENT)
            copy.valid = True
            return record

    def in_place(self, key: str) -> bool:
        """Whether ``key``'s home is still the checkpoint's bytes."""
        with DEFER, self._cond:
            record = self._tensors.get(key)
            copy = record.copies.get(record.home) if record is not None else None
            return copy is not None and isinstance(copy.slot, CheckpointSlot)

    def checkpoint_stats(self) -> dict[str, Any]:
        """Bytes resting in checkpoint files (each range's kept bytes: its tensors and the few
        bytes between them, the covering blocks' ends not counted) and the file ranges they are read as, bytes read from them (whole
        blocks; and of those, read through the page cache), and moved out by a first write."""
        with DEFER, self._cond:
            held = ranges = 0
            for record in self._tensors.values():
                home = record.copies.get(record.home)
                if home is not None and isinstance(home.slot, CheckpointSlot):
                    held += sum(r.length if r.kept is None else r.kept for r in home.slot.ranges)
                    ranges += len(home.slot.ranges)
            nvme = self.tiers.get(Tier.NVME)
            files = getattr(nvme, "opened_checkpoint", None)
            return {"in_place_bytes": held, "ranges": ranges, "read_bytes": files.read_bytes if files is not None else 0,
                    "buffered_read_bytes": files.buffered_read_bytes if files is not None else 0,
                    "moved_bytes": self.moved_bytes, "files": files.files if files is not None else []}

    def _move_out_of_checkpoint(self, record: StoredTensor) -> None:
        """Copy on first write: a swap extent becomes the home of ``record``, whose newest
        bytes are in another copy about to be written home (lock held)."""
        home = record.copies[record.home]
        if not isinstance(home.slot, CheckpointSlot):
            return
        backend = self._backend(record.home)
        home.slot = self._reserve_blocking(record, backend, stage=False)  # (the old slot claimed nothing)
        home.valid = False
        self._count_moved(record, home_moved=True)

    def _count_moved(self, record: StoredTensor, *, home_moved: bool = False) -> None:
        """Count ``record`` as moved out of its checkpoint: its home just moved, or it is
        about to be replaced by a ``put`` (lock held)."""
        home = record.copies.get(record.home)
        if not home_moved and (home is None or not isinstance(home.slot, CheckpointSlot)):
            return
        if self.moved_bytes == 0:
            log.info("offload: %r written for the first time: no longer read from the checkpoint, its new bytes "
                     "rest in the store (copy on first write; the checkpoint is never written)", record.key)
        self.moved_bytes += record.nbytes
