"""Measuring helpers shared by the benchmarks (scripts in this folder import it by path)."""

from __future__ import annotations

import os
import threading
import time

import psutil


class PeakRss:
    """Largest resident set over the ``with`` block (``peak``) and its growth over the RSS at
    entry (``growth``), sampled every 5 ms."""

    def start(self) -> "PeakRss":
        self.proc = psutil.Process()
        self.before = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; returns the peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.growth = self.peak - self.before
        return self.peak

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_bandwidth(path: str, size: int) -> tuple[float, float]:
    """(write, read) GB/s of ``size`` bytes, one request each way, through offload's file
    engine (O_DIRECT, 8 MiB blocks, 32 in flight) from a huge-page host buffer: the disk as
    offload's I/O layer sees it."""
    from offload.io import FileEngine, HostBuffer

    file = os.path.join(path, "raw-bandwidth.bin")
    buf = HostBuffer(size)
    buf.bytes[::4096].fill_(7)
    with FileEngine() as engine:
        fh = engine.open(file, create=True)
        t = time.perf_counter()
        engine.write(fh, 0, buf).wait()
        engine.fsync(fh)
        write = size / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        engine.read(fh, 0, buf).wait()
        read = size / (time.perf_counter() - t) / 1e9
        engine.close_file(fh)
    os.unlink(file)
    return write, read
