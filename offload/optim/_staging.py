"""Pinned host buffers for gradients copied out of a device's memory (``_sink``).

Note: why not the host pool itself. The autograd thread takes a buffer for each gradient
and the drain worker gives it back after adding it into the accumulators; the add itself
may wait for room in the pool (an accumulator, the stage of a write to NVMe). Had the
copies come from the pool, the room the worker waits for could be held by copies queued
behind it while the autograd thread waits for room too: both blocked for good (found on
the simulated device, tests/simdevice/test_drain.py). With buffers of their own, taken
from the pool once and counted in the optimizer's host budget (``GRAD_COPIES``), the
autograd thread waits only for the worker and the worker only for the pool.
"""

from __future__ import annotations

import threading

from .._signals import DEFER, wait
from ..io import BufferPool, HostBuffer

__all__ = ["GradientCopies", "GRAD_COPIES"]

GRAD_COPIES = 2  # buffers: one gradient added while the next is copied


class GradientCopies:
    """``GRAD_COPIES`` buffers of ``nbytes`` (the largest gradient copied at once), taken
    from ``pool`` at first use and given back at ``close``."""

    def __init__(self, pool: BufferPool, nbytes: int):
        self.pool, self.nbytes = pool, nbytes
        self._free: list[HostBuffer] = []
        self._made = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer for a copy of ``nbytes``, waiting for the worker to give one back."""
        if nbytes > self.nbytes:
            raise RuntimeError(f"a gradient of {nbytes} bytes is larger than the {self.nbytes} bytes "
                               "planned for the largest; this is a bug in offload, please report it")
        made = False
        try:
            with DEFER, self._cond:
                while not self._free and self._made >= GRAD_COPIES:
                    wait(self._cond)
                if self._free:
                    return self._free.pop()
                self._made += 1
                made = True
            return self.pool.acquire(self.nbytes)  # (outside the lock: the pool may wait for room)
        except BaseException:
            if made:
                with self._cond:
                    self._made -= 1
                    self._cond.notify_all()
            raise

    def give(self, buffer: HostBuffer) -> None:
        with DEFER, self._cond:
            self._free.append(buffer)
            self._cond.notify_all()

    def close(self) -> None:
        """Give every buffer back to the pool (the adds using them have finished)."""
        with self._cond:
            free, self._free, self._made = self._free, [], 0
        if not self.pool.closed:
            for buf in free:
                self.pool.release(buf)
