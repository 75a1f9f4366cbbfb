"""A pool of page-aligned host buffers (``_hostbuffer``) under a byte budget."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

from .._signals import DEFER, wait as _wait
from .._units import format_size
from ._registry import leave, register
from ..accel import Accelerator
from ._errors import BudgetError
from ._hostbuffer import PAGE_SIZE, HostBuffer, round_up

__all__ = ["BufferPool"]

log = logging.getLogger(__name__)


VIEW_GRACE_S = 1.0  # how long a buffer dropped while viewed may stay viewed before that is said


@dataclass
class _Left:
    """A buffer dropped while a tensor viewed it, watched until the view goes."""
    at: float
    mapping: weakref.ref
    nbytes: int


class BufferPool:
    """Reusable :class:`HostBuffer` s under a byte budget.

    The budget counts every byte the pool holds, buffers in use and buffers cached for
    reuse alike. Freed buffers are kept by exact size (groups of one model repeat sizes).
    A request of another size that needs their room resizes one of them in place where
    it can (``HostBuffer.resize``: an unpinned buffer nothing shares) and drops others
    only for the rest of the room: mapping a new buffer instead would zero every page of
    it again, and a model whose groups alternate between two sizes did that for most of
    its bytes on every pass.

    ``fault_in=False``: new buffers are not faulted in by the thread that asks for them
    but by their first use. For buffers a read fills first (the groups computed on in host
    memory), that is the I/O thread's read, beside the compute rather than in its way:
    a fresh page costs more than it moves when memory is short (compaction for huge
    pages, reclaim under a full page cache; GPT-2 1.5B's first forward: 1.7 s of 8).
    """

    def __init__(self, budget: int, *, pin: Accelerator | None = None, name: str = "host",
                 fault_in: bool = True):
        if budget <= 0:
            raise ValueError(f"{name} buffer pool budget must be > 0 bytes, got {budget}")
        self.budget, self.pin, self.name, self.fault_in = budget, pin, name, fault_in
        self._free: dict[int, list[HostBuffer]] = {}
        self._held = 0  # bytes of all live buffers: in use + cached
        self._cached = 0
        # bytes in use beyond what was asked for (cached buffers reused for smaller requests),
        # and the most of them allowed: None, no limit
        self._inflation = 0
        self.max_inflation: int | None = None
        self._asked: dict[int, int] = {}  # id(buffer) -> bytes asked, for reused larger ones
        self.peak_bytes = 0
        self.mapped = self.resized = 0  # buffers mapped anew, cached ones resized for another size
        self.left_to_holders = 0  # cached buffers dropped while a tensor still viewed them (never reused)
        self.lasting_views = 0  # of those, the ones still viewed VIEW_GRACE_S later (said in the log)
        self._left: list[_Left] = []
        self._cond = threading.Condition()
        self._closed = False
        register(self)

    # -- accounting -------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_use_bytes(self) -> int:
        return self._held - self._cached

    def reset_peak(self) -> None:
        with DEFER, self._cond:
            self.peak_bytes = self._held

    # -- acquire / release ------------------------------------------------------------
    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` now, or ``None`` if the budget is full."""
        size = round_up(max(nbytes, 1), PAGE_SIZE)
        self._check_fits(size)
        with DEFER, self._cond:
            return self._take(size)

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> HostBuffer:
        """A buffer of at least ``nbytes``, waiting up to ``timeout`` s for others' releases."""
        size = round_up(max(nbytes, 1), PAGE_SIZE)
        self._check_fits(size)
        deadline = None if timeout is None else time.monotonic() + timeout
        with DEFER, self._cond:
            while True:
                buf = self._take(size)
                if buf is not None:
                    return buf
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BudgetError(
                        f"{self.name} buffer pool: {size} bytes not free within {timeout}s "
                        f"({self.in_use_bytes} of {self.budget} bytes in use); release buffers "
                        f"or raise the {self.name} budget"
                    )
                _wait(self._cond, remaining)

    def release(self, buf: HostBuffer) -> None:
        with DEFER, self._cond:
            asked = self._asked.pop(id(buf), None)
            if asked is not None:
                self._inflation -= buf.nbytes - asked
            if self._closed:
                self._held -= buf.nbytes
                buf.close()
            else:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._cached += buf.nbytes
                if self._left:
                    self._note_lasting_views()
            self._cond.notify_all()

    def trim(self) -> None:
        """Unmap every cached buffer."""
        with DEFER, self._cond:
            self._drop_all()

    def close(self) -> None:
        with DEFER, self._cond:
            self._closed = True
            self._drop_all(closing=True)
            self._cond.notify_all()

    # -- internals --------------------------------------------------------------------
    def _check_fits(self, size: int) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} buffer pool is closed")
        if size > self.budget:
            raise BudgetError(
                f"{self.name} buffer of {size} bytes can never fit the {self.name} budget of "
                f"{self.budget} bytes: raise the budget above {size} bytes or use smaller groups"
            )

    def _take(self, size: int) -> HostBuffer | None:
        buf = self._pop_reusable(size)
        if buf is not None:
            return buf
        if self._held + size > self.budget:
            # Note: rather than unmapping cached buffers to map a new one (~5 ms per 16 MB,
            # and a pool full of the wrong sizes would do it on every request: measured 680
            # maps in 8 generated tokens), reuse the smallest cached one that fits, up to 2x
            # the request. The caller is charged the buffer's real size.
            # (within max_inflation: what a user of the pool sized its requests for must
            # still fit; a buffer larger than asked takes room from later requests)
            limit = self.max_inflation
            fits = [s for s in self._free if size <= s <= 2 * size
                    and (limit is None or self._inflation + s - size <= limit)]
            buf = self._pop_reusable(min(fits)) if fits else None
            if buf is not None:
                if buf.nbytes > size:
                    self._asked[id(buf)] = size
                    self._inflation += buf.nbytes - size
                return buf
            buf = self._resize_cached(size)
            if buf is not None:
                return buf
            self._make_room(self._held + size - self.budget)
        if self._held + size > self.budget:
            return None
        buf = HostBuffer(size, pin=self.pin, fault_in=self.fault_in)
        self._held += buf.nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.mapped += 1
        return buf

    def _resize_cached(self, size: int) -> HostBuffer | None:
        """A cached buffer of another size made ``size`` in place: the one that makes the
        room with least to spare, as ``_make_room`` would drop it, else the largest with
        others dropped for the rest. None where none can be (pinned pools, a buffer still
        shared, nothing cached, no room even so)."""
        if self.pin is not None or not self._free:
            return None
        need = self._held + size - self.budget
        enough = [s for s in self._free if s >= need]  # (as _make_room would drop: big buffers kept)
        old = min(enough) if enough else max(self._free)
        buf = self._pop_reusable(old)  # (held still counts it)
        if buf is None:  # (each one of that size is still viewed: the room comes from dropping)
            return None
        over = self._held - old + size - self.budget
        if over > 0:
            self._make_room(over)
        if self._held - old + size > self.budget or not buf.resize(size, fault_in=self.fault_in):
            self._free.setdefault(old, []).append(buf)
            self._cached += old
            return None
        self._held += size - old
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.resized += 1
        return buf

    def _pop_reusable(self, size: int) -> HostBuffer | None:
        """A cached buffer of ``size`` that nothing views any more, or None. One a tensor still
        views (a view of a weight kept past its module's forward: a custom Function's
        ``ctx.wt = w.t()``, an output the hooks cannot see into; a graph recomputed by a
        checkpoint, briefly) is not handed out: reused, it would give that holder another
        tensor's bytes. It stays cached for when its views are gone (``_drop`` says what
        happens to it when the room is needed first)."""
        return self._pop_cached(size, viewed=False)

    def _drop(self, buf: HostBuffer, *, closing: bool = False) -> None:
        """Unmap a cached buffer (popped) and stop counting it. One a tensor still views is
        left to that tensor, as torch leaves memory to a view: unmapped with its last view,
        counted by ``pool_bytes()`` beside the pools until then. Said once its view has
        lasted ``VIEW_GRACE_S`` (``_note_lasting_views``): a view the releasing code or an
        I/O callback still holds for a moment is gone by then. (At close, the parameters of
        a model never unwrapped still view theirs: expected, not said.)"""
        self._held -= buf.nbytes
        if buf.shared():
            self.left_to_holders += 1
            leave(self.name, buf.nbytes, buf.mapping)
            if not closing:
                self._left.append(_Left(time.monotonic(), weakref.ref(buf.mapping), buf.nbytes))
        buf.close()

    def _note_lasting_views(self) -> None:
        """Say (once per pool) that a buffer left to a view is still viewed ``VIEW_GRACE_S``
        after it was dropped: a view kept on purpose, outside the budget until it goes."""
        now = time.monotonic()
        while self._left and (self._left[0].mapping() is None or now - self._left[0].at >= VIEW_GRACE_S):
            left = self._left.pop(0)
            if left.mapping() is None:
                continue
            self.lasting_views += 1
            (log.warning if self.lasting_views == 1 else log.debug)(
                "%s buffer pool: a %s buffer dropped for room is still viewed by a tensor offload did not hand "
                "out (a view of a weight kept past its module's forward, as ctx.wt = w.t() in a custom "
                "Function, or saved by the graph of a forward that raised, which its traceback keeps); it "
                "stays with that tensor, outside the budget (counted in offload.stats' pools)",
                self.name, format_size(left.nbytes))

    def _pop_cached(self, size: int, *, viewed: bool | None = None) -> HostBuffer | None:
        """A cached buffer of ``size`` (one a tensor views or not, if ``viewed`` says), or None."""
        bufs = self._free.get(size, [])
        at = next((i for i in range(len(bufs) - 1, -1, -1) if viewed is None or bufs[i].shared() == viewed), None)
        if at is None:
            return None
        buf = bufs.pop(at)
        if not bufs:
            del self._free[size]
        self._cached -= size
        return buf

    def _drop_all(self, *, closing: bool = False) -> None:
        for size in list(self._free):
            while size in self._free:
                self._drop(self._pop_cached(size), closing=closing)

    def _make_room(self, need: int) -> None:
        """Unmap cached buffers until ``need`` bytes are free or none is left: the one that
        makes the room with least to spare where there is one, else the smallest first.
        Dropping the largest first would drop the big buffers a step keeps reusing (the
        optimizer's shards) for a small request, and map them again at the next shard.
        Buffers no tensor views go first: one still viewed is most often a moment from free
        (released by code whose local view has not gone yet), and dropped it is left to that view."""
        self._note_lasting_views()
        freed = 0
        for viewed in (False, True):
            sizes = [size for size, bufs in self._free.items() if any(b.shared() == viewed for b in bufs)]
            fits = [size for size in sizes if size >= need - freed]
            for size in [min(fits)] if fits else sorted(sizes):
                while freed < need:
                    buf = self._pop_cached(size, viewed=viewed)
                    if buf is None:
                        break
                    self._drop(buf)
                    freed += size
            if freed >= need:
                return
