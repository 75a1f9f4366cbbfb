"""Streaming blobs of tensor bytes into and out of checkpoint files, a bounded window at a time.

A *blob* is one contiguous run of bytes in a data file (a parameter group's flat buffer,
an optimizer shard's state rows, a pack of small tensors). Saving fills a host buffer per
blob (a read from the tier where it rests, or a copy), checksums the pieces the manifest
will list, and writes the buffer with the file engine (O_DIRECT: blobs sit at 4 KiB
aligned offsets and are written in whole pages). Loading reads runs of bytes into host
buffers and checks each piece's checksum before anyone uses it. Buffers come from a
:class:`BufferPool` (the wrapped model's host pool when there is one, so they count in
``host_budget``) and at most ``window`` bytes are held at once.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from .._signals import DEFER
from .._units import format_size
from ..io import BudgetError, BufferPool, DiskFullError, FileEngine, HostBuffer, OffloadIOError, round_up
from ._format import ALIGN, CheckpointError, crc32

__all__ = ["Blob", "Piece", "BlobWriter", "ReadRun", "BlobReader", "progress"]

log = logging.getLogger(__name__)


def progress(total: int, desc: str) -> Any:
    """A tqdm bar over bytes when tqdm is installed and logging is at INFO; else None."""
    if not log.isEnabledFor(logging.INFO) or total < (256 << 20):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)


@dataclass
class Piece:
    """One manifest entry inside a blob: ``at`` and ``length`` are bytes within the blob."""

    entry: dict
    at: int
    length: int


@dataclass
class Blob:
    section: str  # the data file
    nbytes: int
    fill: Callable[[torch.Tensor], Any]  # fills dest[:nbytes]; returns a completion or None
    pieces: list[Piece] = field(default_factory=list)
    # optional: (page-aligned host view of the bytes, release) to write without a copy, or None
    borrow: Callable[[], Any] | None = None
    offset: int = 0  # in the file, set by the writer's layout


class BlobWriter:
    """Lays blobs out in their files, then streams them: fill, checksum, write."""

    def __init__(self, blobs: list[Blob], *, pool: BufferPool, window: int,
                 engine_args: dict | None = None):
        self.directory, self.blobs, self.pool = "", blobs, pool
        self.sizes: dict[str, int] = collections.OrderedDict()
        for blob in blobs:
            at = self.sizes.get(blob.section, 0)
            blob.offset = at
            self.sizes[blob.section] = at + round_up(blob.nbytes, ALIGN)
        # one buffer size (the largest blob's), so the pool hands the same buffers back
        # instead of mapping (and faulting in) a new one per blob
        self.buffer_size = max((round_up(b.nbytes, ALIGN) for b in blobs), default=ALIGN)
        self.window = max(window, self.buffer_size)
        self.total = sum(self.sizes.values())
        self.engine_args = engine_args or {}

    def check_space(self, path: str) -> None:
        st = os.statvfs(os.path.dirname(os.path.abspath(path.rstrip("/"))) or "/")
        free = st.f_bavail * st.f_frsize
        need = self.total + (1 << 20)  # and the manifest
        if need > free:
            raise _disk_full(path, need, free)

    def run(self, directory: str) -> None:
        self.directory = directory
        engine = self._engine = FileEngine(**self.engine_args, name="offload-ckpt")
        self._crc = ThreadPoolExecutor(2, thread_name_prefix="offload-crc")  # zlib frees the GIL
        files = self._files = {}
        held: collections.deque = collections.deque()  # [blob, buf, fill, write, crc]
        bar = progress(self.total, "save")
        try:
            for section, size in self.sizes.items():
                path = os.path.join(self.directory, section)
                files[section] = engine.open(path, create=True, exclusive=True)
                if size:
                    try:
                        os.posix_fallocate(files[section].buffered_fd, 0, size)
                    except OSError as err:
                        if err.errno == errno.ENOSPC:
                            raise _disk_full(path, self.total, None) from None
                        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
            in_window = 0
            for index, blob in enumerate(self.blobs):
                # (a view or buffer handed out and recorded in ``held`` together: a Ctrl-C
                # between the two left a view lent for ever, and a later load, eviction or
                # exit waited on it)
                item = [blob, None, None, None]
                with DEFER:
                    item[1] = blob.borrow() if blob.borrow is not None else None
                    if item[1] is not None:  # resting in host memory: written from where it is
                        held.append(item)
                if item[1] is None:
                    while held and in_window + self.buffer_size > self.window:
                        in_window -= self._retire_head(held, bar)
                    buf = _acquire(self.pool, self.buffer_size, held, lambda: self._retire_head(held, bar), "saving",
                                   round_up(blob.nbytes, ALIGN), keep=lambda buf, item=item: _keep(held, item, buf))
                    in_window += buf.nbytes
                    item[2] = blob.fill(buf.bytes)
                self._issue_ready(held)
            while held:
                self._retire_head(held, bar)
            for file in files.values():
                engine.fsync(file)
        except OffloadIOError as err:
            if err.errno == errno.ENOSPC:
                raise _disk_full(err.path, self.total, None) from err
            raise
        finally:
            for item in held:  # an error: let the transfers in flight end before freeing
                for c in (item[2], item[3]):
                    if c is not None:
                        _settle(c.wait)
                if len(item) > 4:
                    item[4].exception()
                _release(self.pool, item[1])
            self._crc.shutdown()
            engine.close()
            self.pool.trim()
            if bar is not None:
                bar.close()

    def _issue_ready(self, held: collections.deque) -> None:
        """Start writing (and checksumming) the blobs whose fill has finished, in order."""
        for item in held:
            if item[3] is not None:
                continue
            if item[2] is not None and not item[2].done():
                return
            self._issue(item)

    def _issue(self, item: list) -> None:
        blob, buf, fill, _ = item
        if fill is not None:
            fill.wait()
        # Note: the write is issued before the checksum is computed; both only read the
        # bytes, and the CRC then runs (on two threads) while the disk writes.
        if not isinstance(buf, HostBuffer):  # borrowed: exactly its bytes (the slot's tail is not ours)
            data = buf[0]
            item[3] = self._engine.write(self._files[blob.section], blob.offset, data, blob.nbytes)
        else:
            data = buf.bytes
            size = round_up(blob.nbytes, ALIGN)
            if size > blob.nbytes:
                data[blob.nbytes: size].zero_()
            item[3] = self._engine.write(self._files[blob.section], blob.offset, buf, size)
        item.append(self._crc.submit(self._checksum, blob, data))

    @staticmethod
    def _checksum(blob: Blob, data: torch.Tensor) -> None:
        for piece in blob.pieces:
            piece.entry["crc32"] = crc32(data[piece.at: piece.at + piece.length])
            piece.entry["file"] = blob.section
            piece.entry["offset"] = blob.offset + piece.at
            piece.entry["length"] = piece.length

    def _retire_head(self, held: collections.deque, bar: Any) -> int:
        item = held[0]
        try:
            if item[3] is None:
                self._issue(item)
            item[3].wait()
            item[4].result()
        finally:  # (an error: the transfers on its buffer end before it is given back)
            for c in (item[2], item[3]):
                if c is not None:
                    _settle(c.wait)
            if len(item) > 4:
                _settle(item[4].exception)
            with DEFER:  # (forgotten and given back together: never twice, never lost)
                held.popleft()
                _release(self.pool, item[1])
        blob, buf = item[0], item[1]
        if bar is not None:
            bar.update(blob.nbytes)
        return buf.nbytes if isinstance(buf, HostBuffer) else 0


def _acquire(pool: BufferPool, size: int, held: collections.deque, finish_oldest: Callable[[], Any],
             what: str, least: int, *, keep: Callable[[HostBuffer], None]) -> HostBuffer:
    """A pool buffer of ``size`` (the stream's one size, so the pool hands the same buffers
    back), or of ``least`` (what this blob needs) where the pool has room for that only,
    finishing our own oldest transfers while the budget is full. (States resting in host
    memory are written from where they rest, yet their size set the stream's: at a tight
    budget only the blob's own size fits.) ``keep`` records it, with no Ctrl-C between."""
    while True:
        with DEFER:
            buf = pool.try_acquire(size)
            if buf is None and least < size:
                buf = pool.try_acquire(least)
            if buf is not None:
                keep(buf)
                return buf
        if not held:
            raise BudgetError(f"{what} needs a host buffer of {format_size(least)} but the host budget "
                              f"({format_size(pool.budget)}) has {format_size(pool.in_use_bytes)} in use: "
                              "raise host_budget (OffloadConfig), or cut the blobs smaller: an optimizer's "
                              "shard_size (offload.AdamW(..., shard_size=N)) or the model's group_bytes")
        finish_oldest()


def _keep(held: collections.deque, entry: list, buf: Any) -> None:
    entry[1] = buf
    held.append(entry)


def _settle(wait: Callable[[], Any]) -> None:
    """After an error: let a transfer (or a checksum) end before its buffer is freed. Its
    own failure follows from the error being raised, which is the one to report."""
    try:
        wait()
    except Exception as err:  # noqa: BLE001 - logged: the error being raised says what went wrong
        log.debug("checkpoint: a transfer in flight ended with %r while an earlier error was raised", err)


def _release(pool: BufferPool, buf: Any) -> None:
    """Give back a pool buffer, or a ``(view, release)`` borrowed from (or lent by) the store."""
    if isinstance(buf, HostBuffer):
        pool.release(buf)
    else:
        buf[1]()


def _disk_full(path: str, needed: int, free: int | None) -> DiskFullError:
    err = DiskFullError("write", path, 0, needed, errno.ENOSPC)
    have = f", {format_size(free)} free" if free is not None else ""
    err.args = (errno.ENOSPC, f"not enough disk space to save the checkpoint at {path!r}: it needs "
                f"{format_size(needed)} ({needed} bytes){have}; free space or save to another disk. "
                "Nothing was replaced: the previous checkpoint at this path is intact")
    err.needed, err.free = needed, free
    return err


# ----------------------------------------------------------------------------------------
@dataclass
class ReadRun:
    """Bytes ``[offset, offset + length)`` of ``file`` into ``dest`` bytes ``[at, at + length)``."""

    file: str
    offset: int
    length: int
    at: int


@dataclass
class ReadItem:
    """One destination buffer: the runs that fill it and the pieces to verify."""

    nbytes: int
    runs: list[ReadRun]
    checks: list[tuple[dict, int]]  # (manifest entry, byte position of its bytes in dest)
    consume: Callable[[torch.Tensor], None]
    phase: int = 0  # dest starts this many bytes into the buffer (file offset alignment)
    # optional: () -> (view, done) | None, the destination's final resting place to read
    # into directly (only used when the item needs nothing but reads: no scratch area)
    in_place: Callable[[], Any] | None = None


def merge_runs(runs: list[ReadRun]) -> list[ReadRun]:
    """Join runs that are contiguous in both the file and the destination (up to a page of
    padding between them, which is read into the destination's padding too)."""
    out: list[ReadRun] = []
    for run in sorted(runs, key=lambda r: (r.file, r.offset)):
        last = out[-1] if out else None
        if last is not None and last.file == run.file:
            gap = run.offset - (last.offset + last.length)
            if 0 <= gap < ALIGN and run.at - last.at == run.offset - last.offset:
                last.length = run.offset + run.length - last.offset
                continue
        out.append(ReadRun(run.file, run.offset, run.length, run.at))
    return out


class BlobReader:
    """Reads items into pool buffers, a window ahead, verifying checksums in order."""

    def __init__(self, directory: str, *, pool: BufferPool, window: int, engine_args: dict | None = None):
        self.directory, self.pool, self.window = directory, pool, window
        self.engine_args = engine_args or {}

    def run(self, items: Iterable[ReadItem], total: int = 0) -> None:
        engine = FileEngine(**self.engine_args, name="offload-ckpt")
        # Note: checksums are verified by two threads (zlib releases the GIL): one core's
        # CRC (~3-4 GB/s with the disk's DMA running) is about as fast as the disk reads.
        self._verifier = ThreadPoolExecutor(2, thread_name_prefix="offload-crc")
        files: dict[str, Any] = {}
        held: collections.deque = collections.deque()
        bar = progress(total, "load")
        in_window = 0
        items = list(items)
        for item in items:
            if item.runs:
                item.phase = (item.runs[0].offset - item.runs[0].at) % ALIGN
        # one buffer size for all items, so the pool hands the same buffers back
        size = max((round_up(i.phase + i.nbytes, ALIGN) for i in items), default=ALIGN)
        try:
            for item in items:
                # [item, the view lent or the buffer, the reads issued, their verification]:
                # in ``held`` from the moment the view or buffer is handed out (see the save's)
                entry: list = [item, None, [], None]
                with DEFER:
                    target = item.in_place() if item.in_place is not None and item.phase == 0 else None
                    if target is not None:
                        entry[1] = target
                        held.append(entry)
                if target is not None:
                    dest = data = target[0]
                else:
                    while held and in_window + size > max(self.window, size):
                        in_window -= self._finish(held, bar)
                    buf = _acquire(self.pool, size, held, lambda: self._finish(held, bar), "loading",
                                   round_up(item.phase + item.nbytes, ALIGN),
                                   keep=lambda buf, entry=entry: _keep(held, entry, buf))
                    in_window += buf.nbytes
                    dest = buf.bytes[item.phase:]
                    data = buf.bytes[item.phase: item.phase + item.nbytes]
                for run in item.runs:
                    if run.file not in files:
                        files[run.file] = engine.open(os.path.join(self.directory, run.file))
                    entry[2].append(engine.read(files[run.file], run.offset, dest[run.at: run.at + run.length]))
                entry[3] = self._verifier.submit(self._verify, item, data, entry[2])
            while held:
                self._finish(held, bar)
        finally:
            for _, buf, handles, verified in held:
                for h in handles:
                    _settle(h.wait)
                if verified is not None:
                    verified.cancel()
                    _settle(verified.exception)
                _release(self.pool, buf)
            self._verifier.shutdown()
            engine.close()
            dest = data = buf = entry = target = None  # (views of the last buffer, which trim() unmaps)
            self.pool.trim()
            if bar is not None:
                bar.close()

    def _verify(self, item: ReadItem, data: torch.Tensor, handles: list) -> None:
        error = self._check(item, data, handles)
        data = None  # (the error's traceback keeps this frame, not the view of a buffer the pool may drop)
        if error is not None:
            raise error

    def _check(self, item: ReadItem, data: torch.Tensor, handles: list) -> CheckpointError | None:
        for h in handles:
            try:
                h.wait()
            except OffloadIOError as err:
                error = CheckpointError(f"incomplete checkpoint: reading {err.path!r} failed ({err}); "
                                        "the file is shorter than its manifest says or unreadable")
                error.__cause__ = err
                return error
        for entry, at in item.checks:
            got = crc32(data[at: at + entry["length"]])
            if got != entry["crc32"]:
                return CheckpointError(
                    f"checksum mismatch in {os.path.join(self.directory, entry['file'])!r} for "
                    f"{entry['name']}{'/' + entry['row'] if 'row' in entry else ''} (bytes "
                    f"{entry['offset']}-{entry['offset'] + entry['length']}): the checkpoint is corrupt; "
                    "load an earlier one")
        return None

    def _finish(self, held: collections.deque, bar: Any) -> int:
        """Verify and consume the oldest item of ``held``, then give its buffer back."""
        item, buf, handles, verified = held[0]
        in_place = not isinstance(buf, HostBuffer)
        try:
            verified.result()
            if not in_place:
                item.consume(buf.bytes[item.phase: item.phase + item.nbytes])
        finally:
            for h in handles:  # (a failed verification need not have waited for every read)
                _settle(h.wait)
            if not verified.done():  # (interrupted while waiting: the checksum may still read it)
                verified.cancel()
                _settle(verified.exception)
            with DEFER:  # (forgotten and given back together: never twice, never lost)
                held.popleft()
                _release(self.pool, buf)
        if bar is not None:
            bar.update(item.nbytes)
        return 0 if in_place else buf.nbytes
