"""The page cache of the swap files: what sits there (``mincore``), and advice to the
kernel about what to read ahead or drop (``madvise``, ``posix_fadvise``).

Used by both NVMe backends: ``SwapFiles.cached_bytes`` (what direct I/O leaves cached)
and ``MmapTier`` (the pages it keeps on purpose). Nothing here reads or writes file data.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os

import numpy as np

__all__ = ["PAGE", "page_span", "mapping_address", "resident_bytes", "file_cached_bytes", "advise_random",
           "advise_willneed", "drop_pages"]

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def page_span(start: int, end: int) -> tuple[int, int]:
    """``[start, end)`` widened to whole pages."""
    return start - start % PAGE, -(-end // PAGE) * PAGE


def mapping_address(mm: mmap.mmap) -> int:
    """The start address of a read-write mapping (the ctypes view is let go at once, so
    the mapping can still be closed)."""
    buf = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(buf)
    del buf
    return address


def resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address + length) (page aligned) resident in memory."""
    pages = (length + PAGE - 1) // PAGE
    if pages == 0:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE


def file_cached_bytes(fd: int) -> int:
    """Bytes of the file open (read-write) as ``fd`` that sit in the page cache: a mapping
    and ``mincore``; nothing is read or written."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        return resident_bytes(mapping_address(mm), size)


def advise_random(mm: mmap.mmap) -> None:
    """No fault-around readahead on ``mm``: its user says what it will read."""
    try:
        mm.madvise(mmap.MADV_RANDOM)
    except (OSError, ValueError) as err:  # advice only: reads stay correct, just read ahead more
        log.debug("MADV_RANDOM refused (%s); the kernel's readahead stays on", err)


def advise_willneed(mm: mmap.mmap, start: int, length: int) -> None:
    """Start reading ``[start, start + length)`` of ``mm`` into the page cache; returns at once."""
    try:
        mm.madvise(mmap.MADV_WILLNEED, start, length)
    except (OSError, ValueError) as err:  # advice only: the copy that follows faults the pages in
        log.debug("MADV_WILLNEED refused (%s); the pages are read when touched", err)


def drop_pages(mm: mmap.mmap, fd: int, start: int, length: int, *, dirty: bool) -> int:
    """Write back (when ``dirty``) and drop ``[start, start + length)`` of a file from the
    page cache and from ``mm``; returns the bytes dropped, 0 if the kernel refused."""
    if dirty:
        try:
            mm.flush(start, length)  # fadvise only drops clean pages
        except (OSError, ValueError) as err:  # the dirty pages stay cached (nothing is lost): say so
            log.warning("offload: writing back pages [%d, %d) of a swap file failed (%s); they stay in "
                        "the page cache", start, start + length, err)
            return 0
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, length)
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    except (OSError, ValueError) as err:  # the pages stay cached: more memory used, data intact
        log.debug("could not drop pages [%d, %d) of fd %d: %s", start, start + length, fd, err)
        return 0
    return length
