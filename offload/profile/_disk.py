"""Disk bandwidth through offload's own file engine, swept over its settings.

Every figure here is what :class:`offload.io.FileEngine` (the code the runtime uses)
achieved for one setting: ``block_size`` bytes per system call, ``queue_depth`` blocks in
the kernel at once, ``threads`` workers. The test file is laid out the way the NVMe tier
lays out a swap file (``posix_fallocate``, then written), so the first write measures
new extents, and later writes measure overwrites, as in every step after the first.

Note: caches. A virtualised or cloud disk answers re-reads of recently read data and
overwrites of recently written data from its host's caches, several times faster than
the runtime ever sees (a step reads what it wrote a step ago, and each byte once). So the
file has two halves: reads walk the first (written once, at the first write, and never
again), writes walk the second, each measurement starting where the last of its kind
stopped. A byte is read again only after half the file of other reads, and overwritten
only after half the file of other writes. The cached figures (the same bytes moved twice
in a row) are measured on purpose, to be reported as such.

Note: memory. A measurement moves its bytes through one host buffer of at most 256 MiB:
each request of the buffer's size targets the next stretch of the file, so many requests
point at the same memory at once. That is harmless here (the bytes written are never
checked and the bytes read are thrown away) and keeps the profiler's footprint small
whatever ``--size`` is. Reads are O_DIRECT (or, for the buffered row, preceded by
dropping the file's pages), so the page cache never serves them.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import mmap
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from .._os import pid_alive
from ..io import FileEngine, HostBuffer, logical_block_size

__all__ = ["DiskSetting", "DiskResult", "DiskProbe", "sweep_grid", "TEST_FILE_PATTERN", "BURST_S"]

log = logging.getLogger(__name__)

TEST_FILE_PATTERN = ".offload-profile-*.tmp"
_MiB = 1 << 20
_BUFFER_MAX = 256 * _MiB
_GRAIN = 32 * _MiB  # the test file is a whole number of these (the largest block swept)
BURST_S = 1.0  # a disk's (or its host's) write-back cache absorbs about the first second


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
    op: str  # "read" | "write" | "first_write" | "cached_read" | "cached_write"
    setting: DiskSetting
    nbytes: int
    seconds: float
    start: int = 0  # where in the test file the measurement began
    # (seconds since the start, bytes done) as each request completed, the last at the
    # end of the fsync for writes: where the first seconds' burst and the rest part
    marks: tuple[tuple[float, int], ...] = ()

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def burst_gbps(self, seconds: float = BURST_S) -> float | None:
        """The rate over the requests done within the first ``seconds``; ``None`` where the
        measurement cannot be split (see :meth:`split`)."""
        if not self.split(seconds):
            return None
        t, done = [(t, done) for t, done in self.marks if 0 < t <= seconds][-1]
        return done / t / 1e9

    def split(self, seconds: float = BURST_S) -> bool:
        """Whether the measurement tells a first-``seconds`` burst from the rest: it lasted at
        least twice ``seconds``, some requests were done within them and some after."""
        early = [done for t, done in self.marks if 0 < t <= seconds]
        return self.seconds >= 2 * seconds and bool(early) and early[-1] < self.nbytes

    def sustained_gbps(self, seconds: float = BURST_S) -> float:
        """The rate after the first ``seconds``; the whole measurement's where it cannot be
        split (see :meth:`split`)."""
        if not self.split(seconds):
            return self.gbps
        t, done = [(t, done) for t, done in self.marks if 0 < t <= seconds][-1]
        return (self.nbytes - done) / (self.seconds - t) / 1e9

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
                if os.path.isdir(path):  # --validate's swap directory
                    shutil.rmtree(path)
                else:
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
        size: bytes of the test file, rounded down to a multiple of 32 MiB, at least 64 MiB:
            reads walk its first half, writes its second.
        time_per_measurement: each sweep measurement moves about this many seconds of
            bytes at the first write's rate (at least 32 MiB, at most half the file), so
            that the sweep's length does not grow with the file or shrink with the disk.
        buffer_bytes: the host buffer every request goes through (at most 256 MiB by
            default), hence the bytes of one request.
    """

    def __init__(self, directory: str, size: int, *, time_per_measurement: float = 1.5,
                 buffer_bytes: int = _BUFFER_MAX):
        self.directory = os.path.abspath(directory)
        self.size = size // _GRAIN * _GRAIN
        self.half = self.size // 2 // _GRAIN * _GRAIN
        if self.half < _GRAIN:
            raise ValueError(f"size {size} is below the 64 MiB a disk measurement needs")
        self.time_per_measurement = time_per_measurement
        self.measure_bytes = self.half
        self.align = logical_block_size(self.directory)
        self.path = os.path.join(self.directory,
                                 f".offload-profile-{os.getpid()}-{secrets.token_hex(4)}.tmp")
        self.results: list[DiskResult] = []
        self.direct_supported: bool | None = None
        self.mmap_results: dict[str, float] = {}  # "cold_read", "warm_read", "write" -> GB/s
        self._buffer: HostBuffer | None = None
        self._buffer_bytes = max(_GRAIN, min(self.half, buffer_bytes) // _GRAIN * _GRAIN)
        # each kind's half of the file (first byte) and where in it the next one starts
        self._region = {"read": 0, "write": self.half}
        self._cursor = {"read": 0, "write": 0}

    # -- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> DiskProbe:
        try:
            self._buffer = HostBuffer(self._buffer_bytes)
            # random bytes: a disk (or its host) that compresses or deduplicates gains nothing
            self._buffer.bytes.random_(0, 256)
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
        many bytes each sweep measurement moves."""
        result = self._measure("first_write", setting, self.size, 0)
        shrunk = int(result.sustained_gbps() * 1e9 * self.time_per_measurement) // _GRAIN * _GRAIN
        self.measure_bytes = max(_GRAIN, min(self.half, shrunk))
        log.info("first write %.2f GB/s (%.2f after the first second): each sweep measurement moves %d MiB "
                 "of the %d MiB file", result.gbps, result.sustained_gbps(), self.measure_bytes >> 20,
                 self.size >> 20)
        return result

    def measure(self, op: str, setting: DiskSetting, nbytes: int | None = None, *,
                record: bool = True) -> DiskResult:
        """Read or write ``nbytes`` (default ``measure_bytes``; rounded down to 32 MiB, at most
        half the file) with ``setting``, in ``op``'s half of the file from where the last
        measurement of ``op`` stopped: bytes not moved recently. ``record=False`` keeps the
        result out of :attr:`results` (the sweep's)."""
        if op not in ("read", "write"):
            raise ValueError(f"op={op!r}: use 'read' or 'write'")
        sweep = nbytes is None
        nbytes = self.stretch(nbytes or self.measure_bytes)
        buffered = not setting.direct or self.direct_supported is False  # O_DIRECT refused here
        if op == "read" and buffered:
            self._drop_cached_pages()
        # a sweep measurement of a slow setting stops after three times its share of time
        result = self._measure(op, setting, nbytes, self._at(op), record=record,
                               deadline=3 * self.time_per_measurement if sweep else None)
        self._cursor[op] = (self._cursor[op] + result.nbytes) % self.half
        if op == "write" and buffered:
            self._drop_cached_pages()
        return result

    def measure_cached(self, op: str, setting: DiskSetting, nbytes: int = 1 << 30) -> DiskResult:
        """The same ``nbytes`` moved twice in a row, the second time timed: the re-read of data
        just read, or the overwrite of data just written, which any cache in the way (the
        drive's, a hypervisor's) serves. A best case the runtime does not see; reported as
        such, never recommended on."""
        if op not in ("read", "write"):
            raise ValueError(f"op={op!r}: use 'read' or 'write'")
        nbytes = self.stretch(nbytes)
        start = self._at(op)
        self._measure(op, setting, nbytes, start, record=False)
        result = self._measure(f"cached_{op}", setting, nbytes, start, record=False)
        self._cursor[op] = (self._cursor[op] + nbytes) % self.half
        return result

    def measure_mmap(self, op: str, *, warm: bool = False, threads: int = 4, chunk: int = 8 << 20) -> float:
        """GB/s of ``io_backend="mmap"``'s transfers on the test file: copies between a shared
        mapping and the buffer, ``chunk`` bytes at a time on ``threads`` workers, each read
        range advised ``MADV_WILLNEED`` when issued (what ``MmapTier`` does). A cold read
        drops the file's pages first; a warm read follows a read of the same bytes (they are
        in the page cache); a write (``pwrite`` into the page cache, as the tier writes) is
        timed to the end of its ``fsync``. Each moves ``measure_bytes`` of ``op``'s half from
        where the last measurement of its kind stopped (in two stretches where it wraps)."""
        buf = self._buffer
        if buf is None:
            raise RuntimeError("DiskProbe used outside its 'with' block")
        nbytes = self.measure_bytes
        kind = "read" if op == "read" else "write"
        first = min(nbytes, self.half - self._cursor[kind])
        stretches = [(self._at(kind), first)] + ([(self._region[kind], nbytes - first)] if first < nbytes else [])
        self._cursor[kind] = (self._cursor[kind] + nbytes) % self.half
        fd = os.open(self.path, os.O_RDWR)
        try:
            with mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED) as mm:
                mm.madvise(mmap.MADV_RANDOM)
                view = torch.frombuffer(mm, dtype=torch.uint8)
                try:
                    if op == "read" and not warm:
                        self._drop_cached_pages()
                    if op == "read" and warm:
                        self._copy_mapped(view, mm, buf, stretches, "read", threads, chunk, fd)  # bring them in
                    started = time.perf_counter()
                    self._copy_mapped(view, mm, buf, stretches, op, threads, chunk, fd)
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
    def _copy_mapped(view, mm, buf, stretches: list[tuple[int, int]], op: str, threads: int, chunk: int,
                     fd: int) -> None:
        room = buf.nbytes // chunk * chunk or buf.nbytes

        def one(offset: int, end: int) -> None:
            n = min(chunk, end - offset)
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
            for start, nbytes in stretches:
                for offset in range(start, start + nbytes, chunk):
                    if op == "read":
                        mm.madvise(mmap.MADV_WILLNEED, offset, min(chunk, start + nbytes - offset))
                    futures.append(pool.submit(one, offset, start + nbytes))
            for f in futures:
                f.result()

    # -- internals --------------------------------------------------------------------------
    def stretch(self, nbytes: int) -> int:
        """``nbytes`` as a measurement moves it: whole 32 MiB, at least one, at most half the file."""
        return max(_GRAIN, min(self.half, nbytes // _GRAIN * _GRAIN))

    def _at(self, op: str) -> int:
        return self._region[op] + self._cursor[op]

    def _measure(self, op: str, setting: DiskSetting, nbytes: int, start: int, *,
                 record: bool = True, deadline: float | None = None) -> DiskResult:
        """Move ``nbytes`` from ``start``: the whole file for the first write, else within
        the half ``start`` is in, wrapping at its end. With a ``deadline`` (seconds), submit
        nothing more once it has passed and count what was submitted."""
        buf = self._buffer
        if buf is None:
            raise RuntimeError("DiskProbe used outside its 'with' block")
        reading = op.endswith("read")
        base, span = (0, self.size) if op == "first_write" else (start // self.half * self.half, self.half)
        with FileEngine(block_size=setting.block_size, threads=setting.threads,
                        queue_depth=setting.queue_depth, direct=setting.direct,
                        name="offload-profile") as engine:
            file = engine.open(self.path)
            if setting.direct:
                self.direct_supported = file.direct
                # a file system that refuses O_DIRECT was measured buffered: say so
                setting = dataclasses.replace(setting, direct=file.direct)
            submit = engine.read if reading else engine.write
            # requests of the setting's bytes in flight (at least 32 MiB), two of them at a
            # time: the queue stays full, and the timing and the deadline see each one land
            request = min(buf.nbytes, max(_GRAIN, setting.queue_depth * setting.block_size // _GRAIN * _GRAIN))
            window = 2
            started = time.perf_counter()
            pending: list = []
            marks: list[tuple[float, int]] = []
            done = 0
            while done < nbytes or pending:
                if done < nbytes and len(pending) < window and not (
                        marks and deadline is not None and marks[-1][0] > deadline):
                    offset = base + (start - base + done) % span
                    n = min(request, nbytes - done, base + span - offset)
                    done += n
                    pending.append((done, submit(file, offset, buf, n)))
                    continue
                total, handle = pending.pop(0)
                handle.wait()
                marks.append((time.perf_counter() - started, total))
                if deadline is not None and marks[-1][0] > deadline:
                    nbytes = done  # stop here: what was submitted is what was measured
            if not reading:
                engine.fsync(file)  # the bytes are on the disk, not in a cache, when the clock stops
                marks.append((time.perf_counter() - started, nbytes))
            seconds = time.perf_counter() - started
            engine.close_file(file)
        result = DiskResult(op, setting, nbytes, seconds, start=start, marks=tuple(marks))
        if record:
            self.results.append(result)
        return result

    def _drop_cached_pages(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
