"""Completion handles of the file engine's requests."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

__all__ = ["IOHandle"]

log = logging.getLogger(__name__)


class IOHandle:
    """Completion of one request. ``wait()`` returns the byte count or raises."""

    __slots__ = ("op", "path", "offset", "length", "_pending", "_error", "_event", "_callbacks",
                 "_lock", "_keepalive", "__weakref__")

    def __init__(self, op: str, path: str, offset: int, length: int, nblocks: int, keepalive: Any):
        self.op, self.path, self.offset, self.length = op, path, offset, length
        self._pending = nblocks
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[IOHandle], None]] = []
        self._lock = threading.Lock()
        self._keepalive = keepalive  # the caller's buffer lives at least as long as the request
        if nblocks == 0:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        """The error, once done; ``None`` if it succeeded (or is still running)."""
        return self._error

    def wait(self, timeout: float | None = None) -> int:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.op} of {self.length} bytes at {self.offset} in {self.path!r} "
                               f"not done after {timeout}s")
        if self._error is not None:
            raise self._error
        return self.length

    def add_done_callback(self, fn: Callable[[IOHandle], None]) -> None:
        """Call ``fn(handle)`` when done: from a worker thread, or now if already done."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _block_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            if self._pending > 0:
                return
            self._keepalive = None
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's failure must not kill the worker
                log.exception("IOHandle callback failed")
