"""The NVMe tier's files: a directory lock, a few large preallocated files, extents in them.

Note: why a few large files. A file per tensor costs an open, a create and a metadata
update per swap and leaves the allocator of the file system to fight fragmentation.
Here space is claimed in ``file_size`` pieces with ``posix_fallocate`` (so a full disk is
found when claiming, not in the middle of a write), descriptors stay open, and freed
extents are reused (first fit, neighbours merged).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import glob
import logging
import os
import socket
import threading
from dataclasses import dataclass

from ..io import DiskFullError, EngineFile, FileEngine, logical_block_size, round_up
from ._pagecache import file_cached_bytes

__all__ = ["SwapFiles", "Extent", "DirectoryLockedError", "free_disk_bytes"]

log = logging.getLogger(__name__)
_SWAP_PATTERN = "offload-swap-*.bin"
_LOCK_NAME = "offload.lock"


class DirectoryLockedError(RuntimeError):
    """Another live process holds the NVMe directory."""


@dataclass(frozen=True)
class Extent:
    file: EngineFile
    offset: int
    length: int


def free_disk_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class _FreeList:
    """Free ranges of one file: sorted starts, lengths; first fit; neighbours merged."""

    def __init__(self, size: int):
        self.size = size
        self.starts, self.lengths = [0], [size]

    def take(self, length: int) -> int | None:
        for i, free in enumerate(self.lengths):
            if free >= length:
                start = self.starts[i]
                if free == length:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += length
                    self.lengths[i] -= length
                return start
        return None

    def give(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:  # merge with left
            i -= 1
            self.lengths[i] += length
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, length)
        if i + 1 < len(self.starts) and self.starts[i] + self.lengths[i] == self.starts[i + 1]:
            self.lengths[i] += self.lengths.pop(i + 1)
            del self.starts[i + 1]


class SwapFiles:
    """Owns one NVMe directory: its lock, its swap files and the extents in them.

    Args:
        path: an existing, writable directory (created if its parent exists).
        engine: the file engine that opens the files and moves their bytes.
        file_size: bytes claimed per swap file (a larger tensor gets a file of its size).
    """

    def __init__(self, path: str, engine: FileEngine, *, file_size: int = 1 << 30):
        self.path = os.path.abspath(path)
        self.engine = engine
        self._created_directory = False
        self._check_directory()
        self._lock_fd = self._take_lock()
        self.align = 0
        self.file_size = file_size
        self._files: list[tuple[EngineFile, _FreeList]] = []
        self._mutex = threading.Lock()
        self._closed = False
        self._deleted: set[str] = set()
        self._remove_stale_files()
        self.align = logical_block_size(self.path)
        self.file_size = round_up(file_size, self.align)

    # -- allocation -------------------------------------------------------------------------
    def extent_size(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1), self.align)

    def allocate(self, length: int) -> Extent:
        with self._mutex:
            for file, free in self._files:
                start = free.take(length)
                if start is not None:
                    return Extent(file, start, length)
            try:
                file, free = self._new_file(max(self.file_size, length))
            except DiskFullError as err:
                if self.file_size <= length or err.free is None or err.free < length:
                    raise
                raise DiskFullError(err.op, err.path, err.offset, err.length, err.errno,
                                    f"swap space is claimed in files of {self.file_size} bytes (OffloadConfig "
                                    f"file_size) and {length} were asked for: set a smaller file_size",
                                    needed=err.needed, free=err.free) from None
            start = free.take(length)
            return Extent(file, start, length)

    def free(self, extent: Extent) -> None:
        with self._mutex:
            for file, free in self._files:
                if file is extent.file:
                    free.give(extent.offset, extent.length)
                    return

    def file_size_of(self, file: EngineFile) -> int:
        """The size claimed for one of this directory's swap files."""
        with self._mutex:
            for f, free in self._files:
                if f is file:
                    return free.size
        raise KeyError(file.path)

    def cached_bytes(self) -> int:
        """Bytes of the swap files in the page cache now (``mincore`` on a mapping)."""
        with self._mutex:
            fds = [file.buffered_fd for file, _ in self._files]
        total = 0
        for fd in fds:
            try:
                total += file_cached_bytes(fd)
            except (OSError, ValueError) as err:  # a statistic only: a file closed meanwhile counts 0
                log.debug("page-cache bytes of fd %d unknown: %s", fd, err)
        return total

    @property
    def file_bytes(self) -> int:
        """Bytes claimed on disk by the swap files."""
        with self._mutex:
            return sum(free.size for _, free in self._files)

    def check_deleted(self) -> list[str]:
        """Warn (once per file) about swap files or the lock that someone deleted while they
        are open (a /tmp cleaner, an ``rm`` in the wrong directory). Nothing is lost: the
        open descriptors keep the data, and the space is freed when the store closes. A
        deleted lock no longer keeps another process out of the directory. Returns the
        newly found paths."""
        with self._mutex:
            files = [(file.path, file.buffered_fd) for file, _ in self._files]
        files.append((os.path.join(self.path, _LOCK_NAME), self._lock_fd))
        found = []
        for path, fd in files:
            try:
                gone = os.fstat(fd).st_nlink == 0
            except OSError as err:  # closed by close() meanwhile: nothing left to warn about
                log.debug("cannot check %s: %s", path, err)
                continue
            if gone and path not in self._deleted:
                self._deleted.add(path)
                found.append(path)
        if found:
            log.warning("offload: %s in nvme_path %r %s deleted while in use: the data is safe "
                        "(the files stay open) and the space is freed when the run closes, but "
                        "keep nvme_path out of directories that are cleaned up (e.g. /tmp)",
                        ", ".join(os.path.basename(p) for p in found), self.path,
                        "was" if len(found) == 1 else "were")
        return found

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close and remove every swap file and release the directory lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            files, self._files = self._files, []
        for file, _ in files:
            self.engine.close_file(file)
            _unlink_at_close(file.path)
        _unlink_at_close(os.path.join(self.path, _LOCK_NAME))
        try:
            os.close(self._lock_fd)
        except OSError as err:  # (the descriptor is released all the same)
            log.debug("closing the lock of %s: %s", self.path, err)
        if self._created_directory:
            try:
                os.rmdir(self.path)  # only if empty: never remove what the user put there
            except OSError as err:  # not empty (the user's files) or gone: leaving it is right
                log.debug("kept nvme_path %s: %s", self.path, err)

    # -- internals --------------------------------------------------------------------------
    def _check_directory(self) -> None:
        fix = "point nvme_path at a writable directory on a local disk"
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        except PermissionError:
            raise PermissionError(f"nvme_path {self.path!r} cannot be reached by this user "
                                  f"(permission denied on a parent directory): {fix}") from None
        if st is not None and not os.path.isdir(self.path):
            raise NotADirectoryError(f"nvme_path {self.path!r} is a file, not a directory: {fix}")
        if st is None:
            parent = os.path.dirname(self.path)
            if not os.path.isdir(parent):
                raise FileNotFoundError(
                    f"nvme_path {self.path!r} does not exist and neither does its parent {parent!r}: "
                    f"create the directory or {fix}")
            try:
                os.mkdir(self.path, 0o700)
                self._created_directory = True
            except OSError as err:
                raise PermissionError(
                    f"nvme_path {self.path!r} could not be created ({err.strerror}): {fix}") from err
        if not os.access(self.path, os.W_OK | os.X_OK):
            if os.statvfs(self.path).f_flag & os.ST_RDONLY:
                raise PermissionError(f"nvme_path {self.path!r} is on a read-only file system: {fix}")
            raise PermissionError(f"nvme_path {self.path!r} is not writable by this user: {fix}")

    def _take_lock(self) -> int:
        lock_path = os.path.join(self.path, _LOCK_NAME)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if holder == f"process {os.getpid()} on {socket.gethostname()}":  # (this one)
                    raise DirectoryLockedError(
                        f"nvme_path {self.path!r} is in use by another wrapped model or store of this process: "
                        "give each its own nvme_path (a subdirectory per model), or unwrap the other first "
                        "(offload.unwrap(model), opt.close() for an optimizer's own store). A model or optimizer "
                        "dropped without that still holds it (a notebook cell run again): use another nvme_path, "
                        "or restart the process") from None
                raise DirectoryLockedError(
                    f"nvme_path {self.path!r} is in use by {holder}: give each process (and each "
                    "store) its own nvme_path, e.g. a subdirectory per rank") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd

    def _remove_stale_files(self) -> None:
        # We hold the lock, so any swap file here was left by a process that died.
        for stale in glob.glob(os.path.join(self.path, _SWAP_PATTERN)):
            log.info("removing stale swap file %s left by a process that exited", stale)
            _unlink_quietly(stale)

    def _new_file(self, size: int) -> tuple[EngineFile, _FreeList]:
        if self._closed:
            raise RuntimeError(f"the NVMe tier at {self.path!r} is closed")
        path = os.path.join(self.path, f"offload-swap-{len(self._files)}.bin")
        free_bytes = free_disk_bytes(self.path)
        if free_bytes < size:
            raise DiskFullError("allocate", path, 0, size, needed=size, free=free_bytes)
        file = self.engine.open(path, create=True, exclusive=True)
        try:
            self.engine.backend.fallocate(file.buffered_fd, 0, size)
        except OSError as err:
            self.engine.close_file(file)
            _unlink_quietly(path)
            if err.errno == errno.ENOSPC:
                raise DiskFullError("allocate", path, 0, size, needed=size,
                                    free=free_disk_bytes(self.path)) from None
            if err.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
            file = self.engine.open(path, create=True)
            self.engine.backend.ftruncate(file.buffered_fd, size)  # sparse where fallocate is missing
        file.min_size = size
        entry = (file, _FreeList(size))
        self._files.append(entry)
        log.debug("claimed swap file %s of %d bytes", path, size)
        return entry


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # already gone (a cleaner, or a second close): what we wanted
        pass


def _unlink_at_close(path: str) -> None:
    """As ``_unlink_quietly``; any other failure (a failed disk) is named in a warning and
    closing goes on: the rest is still released."""
    try:
        _unlink_quietly(path)
    except OSError as err:
        log.warning("offload: could not remove %s at close (%s): it holds only offload's scratch data; remove "
                    "it by hand once the disk is back", path, err)
