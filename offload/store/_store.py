"""The tiered tensor store: where every stored tensor rests, and moving it between tiers.

Each stored tensor has a *home* tier, where it rests, and may have copies in faster
tiers. Every copy is an explicit state machine (:class:`Residency`), changed only
through ``_move``, which checks the transition. Issue and wait are separate calls:

* ``put(key, tensor, tier)`` stores bytes (copied before it returns; the write to a slow
  tier continues in the background),
* ``fetch(key, tier)`` starts making a copy in ``tier`` and returns at once (a prefetch
  is just an early fetch),
* ``wait(key, tier)`` blocks until that copy is there and returns it as a tensor,
* ``evict(key, tier)`` drops a copy, writing it home first if it holds the newest bytes,
* ``delete(key)`` drops every copy.

A fetch that does not fit its tier's budget right now is *queued* and starts, in order,
when evictions free space. One that could never fit raises at once; waiting on a queued
fetch while nothing in flight could ever free space raises too, instead of deadlocking.

The store is one object (one lock, one set of books) written in three files: this one
(the records' lifecycle and the issue/wait/evict calls), ``_transfers.py`` (routes,
reservations, transfers and their completions), ``_lending.py`` (reads and loans that
make no copy in a tier) and ``_behind.py`` (dirty copies whose write home waits until the room is needed).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Mapping

import torch

from .._signals import DEFER, wait as _wait
from .._tensors import lasting
from ..io import BufferPool
from ._behind import WriteBehind
from ._inplace import InPlaceHomes
from ._lending import Lending
from ._records import FASTEST_FIRST, StoredTensor, TierCopy, as_bytes
from ._state import Residency, StoreError, Tier, TransferInterrupted, check_transition
from ._tiers import Done, TierBackend
from ._transfers import BUDGET_NAMES, Transfers, start_transfer

__all__ = ["TensorStore", "StoredTensor"]

log = logging.getLogger(__name__)


class TensorStore(Lending, InPlaceHomes, WriteBehind, Transfers):
    """Tensors in tiers under budgets. See the module docstring for the operations.

    Args:
        tiers: a backend per tier in use (e.g. ``HostMemoryTier``, ``NvmeTier``, a test's fake).
        staging: host buffers for transfers between two tiers that are not host memory
            (NVMe <-> CUDA) and for puts into such tiers; usually the HOST tier's pool so
            that its bytes count in the host budget.
        device: the compute device that the DEVICE tier stands for.
    """

    def __init__(self, tiers: Mapping[Tier, TierBackend], *, staging: BufferPool,
                 device: torch.device | str = "cpu"):
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = dict(tiers)
        self.staging = staging
        self.device = torch.device(device)
        self._tensors: dict[str, StoredTensor] = {}
        self._queues: dict[Tier, list[tuple[StoredTensor, TierCopy]]] = {t: [] for t in self.tiers}
        self._cond = threading.Condition(threading.RLock())
        self._in_flight = 0
        self._writes_waiting: set[StoredTensor] = set()  # a next write home short of a staging buffer
        self._behind: dict[str, Tier] = {}  # copies held back, oldest first (_behind)
        # the settings a refusal names for each tier's budget (a store of saved activations
        # has budgets of its own: activation_host_budget, activation_prefetch)
        self.budget_names: dict[Tier, str] = dict(BUDGET_NAMES)
        self.wait_seconds = 0.0
        self.fetches = 0
        self.fetch_hits = 0  # fetches that found the copy already there or on its way
        self.tracer: Any = None  # an offload._trace.Tracer: every transfer becomes a span
        self._closed = False
        _live_stores.add(self)

    # ------------------------------------------------------------------------------------
    # public operations
    # ------------------------------------------------------------------------------------
    def put(self, key: str, tensor: torch.Tensor, tier: Tier | str | None = None) -> StoredTensor:
        """Store ``tensor``'s bytes under ``key`` with ``tier`` as its home (default: slowest).

        Replaces an existing ``key``. ``tensor`` may be reused as soon as this returns.
        Blocks while the home tier has no room, as long as something in flight will free some.
        """
        home = Tier.parse(tier) if tier is not None else [t for t in FASTEST_FIRST if t in self.tiers][-1]
        backend = self._backend(home)
        source = as_bytes(tensor)
        record = StoredTensor(key, tensor.dtype, tuple(tensor.shape), source.numel(), home)
        # Note: the outer DEFER delivers a Ctrl-C only once the completion's callback is
        # attached: delivered as the locked section ends, it would leave the copy loading
        # and counted in flight with no transfer to end it (close() then waits for ever).
        with DEFER:
            with self._cond:
                self._check_open()
                self._check_fits(record, home)
                if key in self._tensors:
                    self._count_moved(self._tensors[key])  # (a tensor read in place, written anew)
                    self._delete(self._tensors[key])
                self._tensors[key] = record
                copy = record.copy(home)
                if record.nbytes == 0:
                    self._move(record, copy, Residency.RESIDENT)
                    copy.valid = True
                    return record
                direct = backend.addressable or home is Tier.DEVICE
                try:
                    copy.slot = self._reserve_blocking(record, backend, stage=False)
                    if not direct:
                        copy.stage = self._reserve_blocking(record, None, stage=True)
                except BaseException as err:  # no room, or interrupted while waiting for it
                    self._release(record, copy)
                    record.lost = err if isinstance(err, Exception) else \
                        TransferInterrupted(f"the put of {key!r} was interrupted ({type(err).__name__})")
                    raise
                self._move(record, copy, Residency.LOADING)
                self._in_flight += 1
            # Note: the copy runs outside the store's lock, so that I/O workers finishing other
            # transfers are not held up in their completion callbacks while it runs.
            def start() -> Any:
                if direct:
                    backend.consume(copy.slot)
                    backend.tensor(copy.slot)[: record.nbytes].copy_(source)
                    backend.fence(copy.slot)
                    return Done()
                copy.stage.bytes[: record.nbytes].copy_(source)
                return backend.write_from(copy.slot, copy.stage.bytes, record.nbytes)

            completion, interrupt = start_transfer(start, f"put of {key!r}")
            self._trace(completion, "put", record, None, copy.tier)
            completion.add_done_callback(lambda c, r=record, cp=copy: self._loaded(r, cp, None, c))
        if interrupt is not None:
            raise interrupt
        return record

    def fetch(self, key: str, tier: Tier | str, *, priority: int = 1) -> None:
        """Start making ``key`` resident in ``tier``; returns at once.

        ``priority`` 0 is for a fetch that compute is already waiting on; prefetches use 1.
        """
        tier = Tier.parse(tier)
        with DEFER, self._cond:
            record = self._record(key)
            self._fetch(record, tier, priority)

    def wait(self, key: str, tier: Tier | str, *, timeout: float | None = None) -> torch.Tensor | None:
        """Block until ``key`` is resident in ``tier``; return it (``None`` for NVMe).

        Fetches first if nobody did. On CUDA the caller's current stream is made to wait
        for the copy (no host synchronisation).
        """
        tier = Tier.parse(tier)
        started = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        with DEFER, self._cond:
            record = self._record(key)
            copy = record.copies.get(tier)
            if copy is not None:
                self._raise_error(record, copy)  # a fetch that failed: report it, do not retry
            if copy is None or copy.state in (Residency.ABSENT, Residency.STORING):
                self._fetch(record, tier, priority=0)
                copy = record.copies[tier]
            elif copy.state is Residency.QUEUED and copy.priority > 0:
                copy.priority = 0
            if copy.drop_when_idle and copy.state is not Residency.STORING:
                copy.drop_when_idle = False  # an eviction asked for earlier yields to this wait
            while copy.state in (Residency.QUEUED, Residency.LOADING):
                if copy.state is Residency.QUEUED and self._in_flight == 0:
                    self._pump(tier)
                    if copy.state is Residency.QUEUED:
                        if self._shed_for(tier, copy.short_of_staging, record.nbytes):
                            continue  # (writes started: their landing frees the room)
                        raise self._stuck_error(record, tier, staging=copy.short_of_staging)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"tensor {key!r} not resident in {tier.value} after {timeout}s")
                _wait(self._cond, remaining)
            if tier is record.home and copy.state is Residency.RESIDENT and not copy.valid:
                self._bring_home(record, deadline)
            self.wait_seconds += time.perf_counter() - started
            self._raise_error(record, copy)
            if copy.state is Residency.ABSENT:
                raise StoreError(f"tensor {key!r} was evicted from {tier.value} while being waited for")
            return self._view(record, copy)

    def evict(self, key: str, tier: Tier | str) -> None:
        """Drop ``key``'s copy in ``tier``; returns at once.

        A copy holding the newest bytes (``mark_dirty``) is written home first and dropped
        when that write completes. A copy still loading is dropped when it arrives.
        """
        tier = Tier.parse(tier)
        with DEFER, self._cond:
            record = self._record(key)
            copy = record.copies.get(tier)
            if tier is record.home:
                raise StoreError(f"{tier.value} is the home tier of {key!r}; delete() it instead")
            if copy is None or copy.state is Residency.ABSENT or copy.state is Residency.STORING:
                return
            if copy.state is Residency.QUEUED:
                self._queues[tier].remove((record, copy))
                self._move(record, copy, Residency.ABSENT)
                self._release(record, copy)
                return
            if copy.state is Residency.LOADING:
                copy.drop_when_idle = True
                return
            self._backend(tier).fence(copy.slot)
            home = record.copies[record.home]
            if copy.dirty and not home.valid:
                self._write_home(record, copy)
            else:
                self._drop(record, copy)

    def mark_dirty(self, key: str, tier: Tier | str) -> None:
        """Declare that the caller changed the copy in ``tier`` in place.

        Other copies become stale; the home copy is rewritten when this one is evicted (or
        right away if ``tier`` is the home tier).
        """
        tier = Tier.parse(tier)
        with DEFER, self._cond:
            record = self._record(key)
            copy = record.copies.get(tier)
            if copy is None or copy.state is not Residency.RESIDENT:
                raise StoreError(f"mark_dirty({key!r}, {tier.value}): the copy is "
                                 f"{record.state(tier).value}, not resident")
            if record.nbytes == 0:  # (no bytes: every copy holds them; nothing to write, no slot to fence)
                return
            self._backend(tier).fence(copy.slot)
            for other in list(record.copies.values()):
                if other is copy:
                    continue
                other.valid = other.dirty = False  # (stale: nothing in it is newer than home)
                if other.tier is not record.home and other.state is Residency.RESIDENT:
                    self._drop(record, other)
            copy.valid, copy.dirty = True, tier is not record.home
            record.version += 1

    def delete(self, key: str) -> None:
        """Drop every copy of ``key``, after the transfers in flight for it finish."""
        with DEFER, self._cond:
            record = self._tensors.get(key)
            if record is not None:
                self._delete(record)

    def drain(self, timeout: float | None = None) -> None:
        """Block until no transfer is in flight (e.g. the write-backs of an optimizer step)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with DEFER, self._cond:
            while self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._in_flight} transfers still in flight after {timeout}s")
                _wait(self._cond, remaining)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def keys(self) -> list[str]:
        return list(self._tensors)

    def info(self, key: str) -> StoredTensor:
        return self._record(key)

    def state(self, key: str, tier: Tier | str) -> Residency:
        return self._record(key).state(Tier.parse(tier))

    def stats(self) -> dict[str, Any]:
        """Bytes resident per tier now and at peak, bytes moved, seconds spent waiting."""
        with DEFER, self._cond:
            out: dict[str, Any] = {"wait_seconds": self.wait_seconds, "fetches": self.fetches,
                                   "fetch_hits": self.fetch_hits, "in_flight": self._in_flight,
                                   "tensors": len(self._tensors)}
            for tier, backend in self.tiers.items():
                out[tier.value] = {"bytes": backend.used_bytes, "peak_bytes": backend.peak_bytes,
                                   "budget": backend.budget, "read_bytes": backend.read_bytes,
                                   "write_bytes": backend.write_bytes}
            out["host_pool"] = {"bytes": self.staging.held_bytes, "peak_bytes": self.staging.peak_bytes,
                                "budget": self.staging.budget}
            nvme = self.tiers.get(Tier.NVME)
            if nvme is not None and hasattr(nvme, "busy_seconds"):  # workers' seconds moving bytes
                out["nvme"]["busy_seconds"] = nvme.busy_seconds
        if nvme is not None and hasattr(nvme, "cached_bytes") and not self._closed:
            out["nvme"]["page_cache_bytes"] = nvme.cached_bytes()  # mincore: outside the lock
        return out

    def reset_peaks(self) -> None:
        with DEFER, self._cond:
            for backend in self.tiers.values():
                backend.peak_bytes = backend.used_bytes
            self.staging.reset_peak()

    def check_files(self) -> None:
        """Warn once about NVMe swap files deleted underneath the store (see SwapFiles)."""
        nvme = self.tiers.get(Tier.NVME)
        if nvme is not None:
            nvme.files.check_deleted()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish transfers in flight, drop every tensor, release files, threads and buffers."""
        with DEFER, self._cond:
            if self._closed:
                return
            for record in list(self._tensors.values()):
                try:
                    self._delete(record)
                except Exception:  # closing must release everything even after a failure
                    log.exception("while dropping %r on close", record.key)
            self._closed = True
        for backend in self.tiers.values():
            backend.close()
        self.staging.close()
        _live_stores.discard(self)

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one place a copy changes state, and a record's end (lock held) ---------------
    def _move(self, record: StoredTensor, copy: TierCopy, new: Residency) -> None:
        check_transition(record.key, copy.tier, copy.state, new)
        copy.state = new
        self._cond.notify_all()

    def _delete(self, record: StoredTensor) -> None:
        busy = (Residency.LOADING, Residency.STORING)
        idle_since = None
        while any(c.state in busy or c.readers for c in record.copies.values()):
            # Note: a copy loading or storing always has a transfer in flight. With none in
            # flight for 30 s, nothing can end this wait (a completion was lost): raise with
            # the states instead of hanging for ever. Readers alone may be a caller's borrow
            # (borrow_host, overwrite_in_place) that is still working: those are waited for.
            stuck = self._in_flight == 0 and any(c.state in busy for c in record.copies.values())
            if stuck:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 30:
                    states = {c.tier.value: (c.state.value, c.readers) for c in record.copies.values()}
                    raise StoreError(f"cannot delete {record.key!r}: its copies (tier: state, readers) "
                                     f"{states} wait for transfers but none is in flight; this is a bug in "
                                     "offload, please report it with this message")
            else:
                idle_since = None
            _wait(self._cond, 5)
        for copy in record.copies.values():
            if copy.state is Residency.QUEUED:
                self._queues[copy.tier].remove((record, copy))
            if copy.state is not Residency.ABSENT:
                self._move(record, copy, Residency.ABSENT)
            self._release(record, copy)
        self._tensors.pop(record.key, None)
        self._behind.pop(record.key, None)
        self._pump_all()

    # -- helpers --------------------------------------------------------------------------
    def _view(self, record: StoredTensor, copy: TierCopy) -> torch.Tensor | None:
        backend = self.tiers[copy.tier]
        if not backend.addressable and copy.tier is not Tier.DEVICE:
            return None
        if record.nbytes == 0:
            device = self.device if copy.tier is Tier.DEVICE else torch.device("cpu")
            return torch.empty(record.shape, dtype=record.dtype, device=device)
        backend.consume(copy.slot)
        with lasting():  # (a dtype view made in inference mode would be an inference tensor, unwritable after it)
            flat = backend.tensor(copy.slot)[: record.nbytes]
            return flat.view(record.dtype).view(record.shape)

    def _raise_error(self, record: StoredTensor, copy: TierCopy) -> None:
        if copy.error is not None:
            error, copy.error = copy.error, None
            raise error

    def _record(self, key: str) -> StoredTensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in the store") from None

    def _backend(self, tier: Tier) -> TierBackend:
        try:
            return self.tiers[tier]
        except KeyError:
            have = ", ".join(t.value for t in self.tiers)
            raise StoreError(f"this store has no {tier.value} tier (it has: {have})") from None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")


# Note: stores are closed at interpreter exit so their swap files and lock files go away
# even when the user forgets close(); a store killed by a signal leaves files behind,
# which the next store opened in that directory removes (it holds the lock).
_live_stores: weakref.WeakSet[TensorStore] = weakref.WeakSet()


@atexit.register
def _close_all_stores() -> None:
    for store in list(_live_stores):
        try:
            store.close()
        except Exception:
            log.exception("closing a store at exit")
