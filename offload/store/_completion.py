"""Completions of the store's transfers: ``done()``, ``wait()``, ``exception()``,
``add_done_callback()``; one finished when made (``Done``) or later (``Pending``)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

__all__ = ["Completion", "Done", "Pending"]


class Completion(Protocol):
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> Any: ...
    def exception(self) -> BaseException | None: ...
    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


class Done:
    """A completion that finished when it was made (a memory copy), maybe with an error."""

    def __init__(self, error: BaseException | None = None):
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)


class Pending:
    """A completion finished later by ``_finish(error)``, from whatever thread completes it."""

    def __init__(self) -> None:
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._callbacks: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        self._finished.wait(timeout)
        if self._error is not None:
            raise self._error

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._finished.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error = error
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
