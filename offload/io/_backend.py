"""System calls on files, behind a small object so tests can inject faults.

The engine never calls ``os`` directly for data transfer: it goes through a
:class:`FileBackend`, and a test passes a subclass that returns short counts or raises
``EIO`` / ``ENOSPC`` at chosen offsets.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat

__all__ = ["FileBackend", "logical_block_size", "DIRECT_SUPPORTED"]

log = logging.getLogger(__name__)

DIRECT_SUPPORTED = hasattr(os, "O_DIRECT")
_DEFAULT_ALIGN = 4096


class FileBackend:
    """Plain POSIX calls. Every transfer method returns the byte count the OS reported."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def preadv(self, fd: int, buffer: memoryview, offset: int) -> int:
        return os.preadv(fd, [buffer], offset)

    def pwritev(self, fd: int, buffer: memoryview, offset: int) -> int:
        return os.pwritev(fd, [buffer], offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fstat_size(self, fd: int) -> int:
        return os.fstat(fd).st_size


def logical_block_size(path: str) -> int:
    """The alignment O_DIRECT needs for ``path`` (a file or directory), at least a page.

    Read from sysfs for the block device holding ``path`` (``queue/logical_block_size``,
    512 or 4096 on real disks). Raised to the page size so that a buffered tail and a
    direct body never share a page of the page cache. Falls back to 4096 when sysfs has
    no answer (network, overlay and virtual file systems).
    """
    try:
        st = os.stat(path)
        dev = st.st_dev if not stat.S_ISBLK(st.st_mode) else st.st_rdev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for candidate in (f"{base}/queue/logical_block_size", f"{base}/../queue/logical_block_size"):
            try:
                with open(candidate) as fh:
                    return max(int(fh.read().strip()), mmap.PAGESIZE)
            except (OSError, ValueError):  # a partition has no queue/ of its own: try its disk
                continue
    except OSError as err:  # safe: 4 KiB is a multiple of 512 B and 4 KiB sectors
        log.debug("no logical block size for %s (%s): assuming %d", path, err, _DEFAULT_ALIGN)
    return max(_DEFAULT_ALIGN, mmap.PAGESIZE)


def is_direct_refusal(err: OSError) -> bool:
    """True when ``err`` means "this file system does not do O_DIRECT", not a real failure."""
    return err.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
