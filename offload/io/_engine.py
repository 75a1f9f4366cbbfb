"""The async file engine: byte ranges between host memory and files, over worker threads.

A request (read or write of ``length`` bytes at a file offset) is split into blocks of
``block_size``; the blocks wait in a priority queue and ``threads`` workers execute them
with ``os.preadv`` / ``os.pwritev``, which release the GIL, so the transfers run in
parallel with Python code and with each other. At most ``queue_depth`` blocks are in the
kernel at once. ``read()`` / ``write()`` return an :class:`IOHandle` at once;
``IOHandle.wait()`` returns the byte count or raises :class:`OffloadIOError`.

Note: alignment. O_DIRECT needs the file offset, the memory address and the length to
be multiples of the file's alignment (the logical block size, raised to a page). A
request that is aligned goes direct in full; an unaligned head or tail goes through a
second, buffered descriptor of the same file. Because the alignment is at least a page,
a buffered piece never shares a page-cache page with a direct piece, so the kernel keeps
the two coherent. A file system that refuses O_DIRECT (tmpfs, overlayfs, some network
file systems) gets buffered I/O throughout, with one warning.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ._backend import DIRECT_SUPPORTED, FileBackend, is_direct_refusal, logical_block_size
from ._hostbuffer import HostBuffer
from ._errors import DiskFullError, EngineClosedError, OffloadIOError
from ._handle import IOHandle

__all__ = ["FileEngine", "EngineFile", "EngineStats"]

log = logging.getLogger(__name__)
_warned_buffered: set[str] = set()


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------
class EngineFile:
    """An open file of the engine: a direct descriptor (when allowed) and a buffered one."""

    def __init__(self, path: str, buffered_fd: int, direct_fd: int | None, align: int):
        self.path, self.buffered_fd, self.direct_fd, self.align = path, buffered_fd, direct_fd, align
        self.retired_fds: list[int] = []  # direct descriptors given up on; closed with the file
        self.closed = False
        # (a swap file's claimed size: a write into it while it is shorter would grow it
        # again with zeros where its data was, so it is refused instead)
        self.min_size = 0

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    def agrees(self, offset: int, address: int) -> bool:
        """Whether bytes at file ``offset`` and memory ``address`` can move O_DIRECT: the
        file has a direct descriptor and the two agree modulo its alignment (the body of
        such a request goes direct, its unaligned ends buffered)."""
        return self.direct and (offset - address) % self.align == 0

    def __repr__(self) -> str:
        return f"EngineFile({self.path!r}, direct={self.direct}, align={self.align})"


@dataclass
class _Block:
    handle: IOHandle
    file: EngineFile
    op: str
    offset: int
    view: memoryview
    direct: bool


@dataclass
class EngineStats:
    read_bytes: int = 0
    buffered_read_bytes: int = 0  # of read_bytes, those read through the page cache (not O_DIRECT)
    write_bytes: int = 0
    read_requests: int = 0
    write_requests: int = 0
    busy_seconds: float = 0.0  # summed over workers: time spent inside system calls


def _memoryview_of(buffer: Any, length: int | None) -> tuple[memoryview, int, Any]:
    """(writable byte view, address, object to keep alive) for a request's memory."""
    if isinstance(buffer, HostBuffer):
        view = buffer.memoryview()
        return (view if length is None else view[:length]), buffer.address, buffer
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError(f"the file engine moves host memory; got a tensor on {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError("the file engine needs a contiguous tensor; call .contiguous() first")
        nbytes = buffer.numel() * buffer.element_size()
        if length is not None:
            if length > nbytes:
                raise ValueError(f"length {length} exceeds the tensor's {nbytes} bytes")
            nbytes = length
        address = buffer.data_ptr()
        if nbytes == 0:
            return memoryview(bytearray()), address, buffer
        raw = (ctypes.c_char * nbytes).from_address(address)
        return memoryview(raw).cast("B"), address, buffer
    view = memoryview(buffer).cast("B")
    if length is not None:
        view = view[:length]
    address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly and len(view) else 0
    return view, address, buffer


# ---------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------
class FileEngine:
    """Owns worker threads and file descriptors; moves bytes between memory and files.

    Args:
        block_size: bytes per system call for large requests (rounded to the alignment).
        threads: worker threads, each issuing blocking ``preadv`` / ``pwritev``.
        queue_depth: most blocks inside system calls at once (``<= threads`` to cap it).
        direct: use O_DIRECT where the file system allows it.
        backend: the object making the system calls (tests pass a faulty one).
    """

    def __init__(self, *, block_size: int = 8 << 20, threads: int = 32, queue_depth: int = 32,
                 direct: bool = True, backend: FileBackend | None = None, name: str = "offload-io"):
        if block_size < 4096 or block_size % 4096:
            raise ValueError(f"block_size={block_size} must be a positive multiple of 4096 bytes")
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        if queue_depth < 1:
            raise ValueError(f"queue_depth={queue_depth} must be >= 1")
        self.block_size, self.threads, self.queue_depth = block_size, threads, queue_depth
        self.direct = direct and DIRECT_SUPPORTED
        self.backend = backend or FileBackend()
        self.stats = EngineStats()
        self._heap: list[tuple[int, int, _Block]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._closed = False
        self._files: set[EngineFile] = set()
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()
        _live_engines.add(self)

    # -- files ----------------------------------------------------------------------------
    def open(self, path: str, *, create: bool = False, exclusive: bool = False,
             readonly: bool = False) -> EngineFile:
        """Open ``path`` for reading and writing (mode 0600 when created), or for reading
        only (``readonly``: a file offload must never change, such as a checkpoint)."""
        self._check_open()
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
        if create:
            flags |= os.O_CREAT | (os.O_EXCL if exclusive else 0)
        buffered_fd = self.backend.open(path, flags, 0o600)
        direct_fd = None
        if self.direct:
            try:
                direct_fd = self.backend.open(path, (flags & ~(os.O_CREAT | os.O_EXCL)) | os.O_DIRECT)
            except OSError as err:
                if not is_direct_refusal(err):
                    self.backend.close(buffered_fd)
                    raise
                self._warn_buffered(path, err)
        file = EngineFile(path, buffered_fd, direct_fd, logical_block_size(path))
        with self._cond:
            self._files.add(file)
        return file

    def close_file(self, file: EngineFile) -> None:
        with self._cond:
            if file.closed:
                return
            file.closed = True
            self._files.discard(file)
        for fd in (file.direct_fd, file.buffered_fd, *file.retired_fds):
            if fd is not None:
                try:
                    self.backend.close(fd)
                except OSError as err:  # (Linux releases the descriptor even so: the others are closed too)
                    log.warning("offload: closing %s reported %s (a failed disk?); it is closed", file.path, err)

    def fsync(self, file: EngineFile) -> None:
        self.backend.fsync(file.buffered_fd)

    # -- requests -------------------------------------------------------------------------
    def read(self, file: EngineFile, offset: int, dest: Any, length: int | None = None, *,
             priority: int = 1) -> IOHandle:
        """Read into ``dest`` (HostBuffer, CPU tensor, or writable buffer) from ``offset``.

        Lower ``priority`` runs first: 0 for a demand miss, 1 (default) for prefetch.
        """
        return self._submit("read", file, offset, dest, length, priority)

    def write(self, file: EngineFile, offset: int, src: Any, length: int | None = None, *,
              priority: int = 1) -> IOHandle:
        """Write ``src`` (HostBuffer, CPU tensor, or buffer) at ``offset``."""
        return self._submit("write", file, offset, src, length, priority)

    def close(self) -> None:
        """Fail pending requests, stop the workers, close every file. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._heap = self._heap, []
            self._cond.notify_all()
        for _, _, block in pending:
            block.handle._block_done(EngineClosedError(
                f"{block.op} at offset {block.offset} in {block.file.path!r} cancelled: engine closed"))
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join()
        for file in list(self._files):
            self.close_file(file)
        _live_engines.discard(self)

    def __enter__(self) -> FileEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------
    def _check_open(self, file: EngineFile | None = None) -> None:
        if self._closed:
            raise EngineClosedError("the file engine is closed")
        if file is not None and file.closed:
            raise EngineClosedError(f"{file.path!r} was closed")

    def _submit(self, op: str, file: EngineFile, offset: int, buffer: Any, length: int | None,
                priority: int) -> IOHandle:
        self._check_open(file)  # early, before any work; the check that counts is below
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        view, address, keepalive = _memoryview_of(buffer, length)
        if op == "read" and view.readonly:
            raise ValueError("read() needs a writable destination buffer")
        pieces = self._split(file, offset, address, len(view))
        handle = IOHandle(op, file.path, offset, len(view), len(pieces), keepalive)
        with self._cond:
            # Note: checked again under the lock close() takes. A close() since the first
            # check has already failed what was queued and stopped the workers: blocks
            # pushed now would never run and the handle never complete.
            self._check_open(file)
            for start, size, direct in pieces:
                block = _Block(handle, file, op, offset + start, view[start:start + size], direct)
                heapq.heappush(self._heap, (priority, next(self._seq), block))
            if op == "read":
                self.stats.read_requests += 1
            else:
                self.stats.write_requests += 1
            self._cond.notify(len(pieces))
        return handle

    def _split(self, file: EngineFile, offset: int, address: int, length: int) -> list[tuple[int, int, bool]]:
        """(start, size, direct) pieces of a request, each at most one block."""
        align = file.align
        body_start, body_end = 0, 0
        if file.agrees(offset, address):
            body_start = min(length, (-offset) % align)
            body_end = body_start + (length - body_start) // align * align
        pieces: list[tuple[int, int, bool]] = []
        for lo, hi, direct in ((0, body_start, False), (body_start, body_end, True), (body_end, length, False)):
            for start in range(lo, hi, self.block_size):
                pieces.append((start, min(self.block_size, hi - start), direct))
        return pieces

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, _, block = heapq.heappop(self._heap)
            with self._slots:
                started = time.perf_counter()
                error = self._transfer(block)
                elapsed = time.perf_counter() - started
            with self._cond:
                self.stats.busy_seconds += elapsed
                if error is None:
                    if block.op == "read":
                        self.stats.read_bytes += len(block.view)
                        if not (block.direct and block.file.direct):
                            self.stats.buffered_read_bytes += len(block.view)
                    else:
                        self.stats.write_bytes += len(block.view)
            block.handle._block_done(error)

    def _transfer(self, block: _Block) -> BaseException | None:
        """Move one block fully, retrying short counts; return the error instead of raising."""
        file, view, done = block.file, block.view, 0
        call = self.backend.preadv if block.op == "read" else self.backend.pwritev
        direct = block.direct and file.direct
        if file.min_size and block.op == "write":
            try:
                size = os.fstat(file.buffered_fd).st_size
            except OSError as err:
                return self._error(block, 0, err.errno, "")
            if size < file.min_size:
                return self._error(block, 0, None, f"the file is {size} bytes, shorter than the {file.min_size} "
                                   "offload claimed: something outside offload truncated it, and what it held "
                                   "past that is lost")
        while done < len(view):
            fd = file.direct_fd if direct else file.buffered_fd
            try:
                n = call(fd, view[done:], block.offset + done)
            except OSError as err:
                if direct and is_direct_refusal(err) and done == 0 and self._demote(file, err):
                    direct = False
                    continue
                return self._error(block, done, err.errno, "")
            except Exception as err:  # never leave a handle pending
                return self._error(block, done, None, repr(err))
            if n <= 0:
                detail = ("end of file: the file is shorter than expected; was it truncated?"
                          if block.op == "read" else "the OS wrote nothing")
                return self._error(block, done, errno.ENOSPC if block.op == "write" else None, detail)
            moved = done + n
            if direct and moved % file.align:
                # a short direct transfer that ended inside a block: the rest would be
                # unaligned, so redo that block (same bytes) directly, or, when not one
                # whole block moved, finish through the page cache
                aligned = moved - moved % file.align
                if aligned > done:
                    moved = aligned
                else:
                    direct = False
            done = moved
        return None

    def _error(self, block: _Block, done: int, err: int | None, detail: str) -> OffloadIOError:
        offset, length = block.offset + done, len(block.view) - done
        if err == errno.ENOSPC:
            return DiskFullError(block.op, block.file.path, offset, length, err, detail)
        return OffloadIOError(block.op, block.file.path, offset, length, err, detail)

    def _demote(self, file: EngineFile, err: OSError) -> bool:
        """The file system accepted O_DIRECT at open but refuses it on transfer.

        The descriptor is retired, not closed: another worker may be inside a call on it.
        """
        with self._cond:
            fd, file.direct_fd = file.direct_fd, None
            if fd is not None:
                file.retired_fds.append(fd)
        if fd is not None:
            self._warn_buffered(file.path, err)
        return True

    @staticmethod
    def _warn_buffered(path: str, err: OSError) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in _warned_buffered:
            _warned_buffered.add(directory)
            log.warning("O_DIRECT is not available in %s (%s); using buffered I/O there, which goes "
                        "through the page cache", directory, os.strerror(err.errno or 0))


# Note: why a registry of live engines. Workers are daemon threads so that a forgotten
# engine never blocks interpreter exit, but daemon threads die mid-call at exit; closing
# the engines first lets them finish their current block and release their descriptors.
_live_engines: weakref.WeakSet[FileEngine] = weakref.WeakSet()


def _close_all_engines() -> None:
    for engine in list(_live_engines):
        engine.close()


atexit.register(_close_all_engines)
