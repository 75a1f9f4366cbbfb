"""Disk bandwidth through offload's own file engine, swept over its settings.

Every figure here is what :class:`offload.io.FileEngine` (the code the runtime uses)
achieved for one setting: ``block_size`` bytes per system call, ``queue_depth`` blocks in
the kernel at once, ``threads`` workers. The test file is laid out the way the NVMe tier
lays out a swap file (``posix_fallocate``, then written), so the first write measures
new extents, and the sweep's writes measure overwrites, as in every step after the first.

Note: memory. A measurement moves the whole test file through one host buffer of at most
256 MiB: each request of the buffer's size targets the next stretch of the file, so many
requests point at the same memory at once. That is harmless here (the bytes written are
never checked and the bytes read are thrown away) and keeps the profiler's footprint
small whatever ``--size`` is. Reads are O_DIRECT (or, for the buffered row, preceded by
dropping the file's pages), so the page cache never serves them.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import mmap
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from .._os import pid_alive
from ..io import FileEngine, HostBuffer, logical_block_size

__all__ = ["DiskSetting", "DiskResult", "DiskProbe", "sweep_grid", "TEST_FILE_PATTERN"]

log = logging.getLogger(__name__)

TEST_FILE_PATTERN = ".offload-profile-*.tmp"
_MiB = 1 << 20
_BUFFER_MAX = 256 * _MiB
_GRAIN = 32 * _MiB  # the test file is a whole number of these (the largest block swept)


@dataclass(frozen=True)
class DiskSetting:
    block_size: int
    queue_depth: int
    threads: int
    direct: bool = True

    def label(self) -> str:
        kind = "O_DIRECT" if self.direct else "buffered"
        return f"{self.block_size >> 20} MiB blocks, queue depth {self.queue_depth}, {self.threads} threads, {kind}"


@dataclass
class DiskResult:
    op: str  # "read" | "write" | "first_write"
    setting: DiskSetting
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def to_dict(self) -> dict:
        return {"op": self.op, **asdict(self.setting), "bytes": self.nbytes,
                "seconds": round(self.seconds, 6), "gbps": round(self.gbps, 4)}


def sweep_grid(mode: str) -> list[DiskSetting]:
    """The settings measured: ``quick`` (12, about 15 s on a 2 GB/s disk at 1 GiB) or
    ``full`` (block sizes 256 KiB-32 MiB x queue depths 1-64, threads = depth and 2x depth)."""
    if mode == "quick":
        blocks, depths, factors = (1, 4, 8, 16), (4, 16, 32), (1,)
    elif mode == "full":
        blocks, depths, factors = (0.25, 1, 2, 4, 8, 16, 32), (1, 2, 4, 8, 16, 32, 64), (1, 2)
    else:
        raise ValueError(f"mode={mode!r}: use 'quick' or 'full'")
    # Note: threads beyond queue_depth wait on the engine's semaphore, so they only help by
    # having the next call ready; fewer threads than the depth cap it at the thread count.
    return [DiskSetting(int(b * _MiB), d, d * f) for b in blocks for d in depths for f in factors]


def remove_stale_test_files(directory: str) -> list[str]:
    """Remove test files left in ``directory`` by profiler runs whose process is gone."""
    removed = []
    for path in glob.glob(os.path.join(directory, TEST_FILE_PATTERN)):
        try:
            pid = int(os.path.basename(path).split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


class DiskProbe:
    """One test file in ``directory`` and the measurements made on it. Use as a context
    manager: the file is removed on exit, whatever ends the block (Ctrl-C included).

    Args:
        directory: where the test file goes (the directory the runtime would use).
        size: bytes of the test file, rounded down to a multiple of 32 MiB.
        time_per_measurement: if the first write shows that moving ``size`` bytes would
            take longer than this, each later measurement moves fewer bytes (at least 64
            MiB), so that a slow disk does not stretch the sweep to many minutes.
    """

    def __init__(self, directory: str, size: int, *, time_per_measurement: float = 1.5):
        self.directory = os.path.abspath(directory)
        self.size = size // _GRAIN * _GRAIN
        if self.size < _GRAIN:
            raise ValueError(f"size {size} is below the 32 MiB a disk measurement needs")
        self.time_per_measurement = time_per_measurement
        self.measure_bytes = self.size
        self.align = logical_block_size(self.directory)
        self.path = os.path.join(self.directory,
                                 f".offload-profile-{os.getpid()}-{secrets.token_hex(4)}.tmp")
        self.results: list[DiskResult] = []
        self.direct_supported: bool | None = None
        self.mmap_results: dict[str, float] = {}  # "cold_read", "warm_read", "write" -> GB/s
        self._buffer: HostBuffer | None = None

    # -- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> DiskProbe:
        try:
            self._buffer = HostBuffer(min(self.size, _BUFFER_MAX))
            self._buffer.bytes[:: 4096].fill_(0x5A)  # something other than zeros on disk
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
        except BaseException:  # ENOSPC in a race with another writer, Ctrl-C: leave nothing
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    # -- measurements -----------------------------------------------------------------------
    def first_write(self, setting: DiskSetting) -> DiskResult:
        """Write the whole file once (new extents, as a swap file's first write); sets how
        many bytes later measurements move."""
        result = self._measure("first_write", setting, self.size)
        seconds_for_all = self.size / (result.gbps * 1e9)
        if seconds_for_all > self.time_per_measurement:
            shrunk = int(result.gbps * 1e9 * self.time_per_measurement) // _GRAIN * _GRAIN
            self.measure_bytes = max(2 * _GRAIN, min(self.size, shrunk))
            log.info("the disk wrote %.2f GB/s: each measurement moves %d MiB of the %d MiB file",
                     result.gbps, self.measure_bytes >> 20, self.size >> 20)
        return result

    def measure(self, op: str, setting: DiskSetting) -> DiskResult:
        """Read or write ``measure_bytes`` of the file with ``setting``."""
        if op not in ("read", "write"):
            raise ValueError(f"op={op!r}: use 'read' or 'write'")
        if op == "read" and not setting.direct:
            self._drop_cached_pages()
        result = self._measure(op, setting, self.measure_bytes)
        if op == "write" and not setting.direct:
            self._drop_cached_pages()
        return result

    def measure_mmap(self, op: str, *, warm: bool = False, threads: int = 4, chunk: int = 8 << 20) -> float:
        """GB/s of ``io_backend="mmap"``'s transfers on the test file: copies between a shared
        mapping and the buffer, ``chunk`` bytes at a time on ``threads`` workers, each read
        range advised ``MADV_WILLNEED`` when issued (what ``MmapTier`` does). A cold read
        drops the file's pages first; a warm read follows a read of the same bytes (they are
        in the page cache); a write (``pwrite`` into the page cache, as the tier writes) is
        timed to the end of its ``fsync``."""
        buf = self._buffer
        if buf is None:
            raise RuntimeError("DiskProbe used outside its 'with' block")
        nbytes = self.measure_bytes
        fd = os.open(self.path, os.O_RDWR)
        try:
            with mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED) as mm:
                mm.madvise(mmap.MADV_RANDOM)
                view = torch.frombuffer(mm, dtype=torch.uint8)
                try:
                    if op == "read" and not warm:
                        self._drop_cached_pages()
                    if op == "read" and warm:
                        self._copy_mapped(view, mm, buf, nbytes, "read", threads, chunk, fd)  # bring them in
                    started = time.perf_counter()
                    self._copy_mapped(view, mm, buf, nbytes, op, threads, chunk, fd)
                    if op == "write":
                        os.fsync(fd)
                    seconds = time.perf_counter() - started
                finally:
                    del view
        finally:
            os.close(fd)
        if op == "write" or warm:
            self._drop_cached_pages()  # leave the page cache as the other measurements expect it
        gbps = nbytes / seconds / 1e9
        self.mmap_results[f"{'warm' if warm else 'cold'}_{op}" if op == "read" else op] = gbps
        return gbps

    @staticmethod
    def _copy_mapped(view, mm, buf, nbytes: int, op: str, threads: int, chunk: int, fd: int) -> None:
        room = buf.nbytes // chunk * chunk or buf.nbytes

        def one(offset: int) -> None:
            n = min(chunk, nbytes - offset)
            at = offset % room
            if op == "read":
                buf.bytes[at: at + n].copy_(view[offset: offset + n])
            else:  # as MmapTier writes: pwrite of whole pages into the page cache
                data = memoryview(buf.bytes[at: at + n].numpy()).cast("B")
                done = 0
                while done < n:
                    done += os.pwrite(fd, data[done:], offset + done)

        with ThreadPoolExecutor(threads, thread_name_prefix="offload-profile-mmap") as pool:
            futures = []
            for offset in range(0, nbytes, chunk):
                if op == "read":
                    mm.madvise(mmap.MADV_WILLNEED, offset, min(chunk, nbytes - offset))
                futures.append(pool.submit(one, offset))
            for f in futures:
                f.result()

    # -- internals --------------------------------------------------------------------------
    def _measure(self, op: str, setting: DiskSetting, nbytes: int) -> DiskResult:
        buf = self._buffer
        if buf is None:
            raise RuntimeError("DiskProbe used outside its 'with' block")
        with FileEngine(block_size=setting.block_size, threads=setting.threads,
                        queue_depth=setting.queue_depth, direct=setting.direct,
                        name="offload-profile") as engine:
            file = engine.open(self.path)
            if setting.direct:
                self.direct_supported = file.direct
                # a file system that refuses O_DIRECT was measured buffered: say so
                setting = dataclasses.replace(setting, direct=file.direct)
            chunk = buf.nbytes
            started = time.perf_counter()
            submit = engine.read if op == "read" else engine.write
            handles = [submit(file, offset, buf, min(chunk, nbytes - offset))
                       for offset in range(0, nbytes, chunk)]
            for handle in handles:
                handle.wait()
            if op != "read":
                engine.fsync(file)  # the bytes are on the disk, not in a cache, when the clock stops
            seconds = time.perf_counter() - started
            engine.close_file(file)
        result = DiskResult(op, setting, nbytes, seconds)
        self.results.append(result)
        return result

    def _drop_cached_pages(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
