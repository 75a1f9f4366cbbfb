"""Ctrl-C inside the runtime's bookkeeping: held back until the bookkeeping is consistent.

A KeyboardInterrupt is raised in the main thread at whatever bytecode it reaches; landing
in the middle of the store's or a buffer pool's bookkeeping (a copy marked loading whose
transfer was never issued, a free list half updated) would leave it inconsistent, so that
a later ``close()`` fails or waits for ever. While the main thread is inside such a
section, :data:`DEFER` swaps the SIGINT handler for one that only records the signal, and
puts the original back (calling it, i.e. raising KeyboardInterrupt, if a signal came) when
the outermost section ends. Blocking waits inside a section run under :data:`ALLOW`,
which reinstates the original handler for their duration: Ctrl-C still interrupts a wait
on a hung disk, at a point where the bookkeeping is consistent.

The swap costs about 8 us per outermost section, in the main thread only; worker threads
never receive Python signal handlers, so for them both are no-ops.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["DEFER", "ALLOW", "wait"]


class _State:
    depth = 0
    original: Any = None  # the handler we replaced while deferring, else None
    pending: Any = None  # the frame of a SIGINT received while deferring
    suspended = False  # inside ALLOW: the original handler is installed


_state = _State()
_main = threading.main_thread()


def _record(signum: int, frame: Any) -> None:
    _state.pending = frame if frame is not None else True


def _deliver(original: Any) -> None:
    pending, _state.pending = _state.pending, None
    if pending is not None and callable(original):
        original(signal.SIGINT, pending if pending is not True else None)


class _Defer:
    __slots__ = ()

    def __enter__(self) -> None:
        if threading.current_thread() is not _main:
            return
        st = _state
        if st.depth == 0:
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):  # SIG_DFL / SIG_IGN: nothing to defer
                st.original = handler
                signal.signal(signal.SIGINT, _record)
        st.depth += 1

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is not _main:
            return
        st = _state
        st.depth -= 1
        if st.depth == 0:
            st.suspended = False
        if st.depth == 0 and st.original is not None:
            original, st.original = st.original, None
            signal.signal(signal.SIGINT, original)
            if exc[0] is None:
                _deliver(original)
            else:
                st.pending = None  # already leaving with an exception


class _Allow:
    __slots__ = ()

    def __enter__(self) -> None:
        st = _state
        if threading.current_thread() is not _main or st.original is None or st.suspended:
            return
        signal.signal(signal.SIGINT, st.original)
        st.suspended = True
        _deliver(st.original)  # a Ctrl-C held back so far is raised here, before waiting

    def __exit__(self, *exc: object) -> None:
        st = _state
        if threading.current_thread() is not _main or not st.suspended:
            return
        st.suspended = False
        if st.original is not None:
            signal.signal(signal.SIGINT, _record)


DEFER = _Defer()
ALLOW = _Allow()


def wait(cond: threading.Condition, timeout: float | None = None) -> bool:
    """``cond.wait(timeout)`` with Ctrl-C allowed (see :data:`ALLOW`)."""
    with ALLOW:
        return cond.wait(timeout)
