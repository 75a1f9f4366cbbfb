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
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .._signals import DEFER, wait as _wait
from ..io import BudgetError, BufferPool, HostBuffer, OffloadIOError
from ._state import Residency, StoreError, Tier, TransferInterrupted, check_transition
from ._tiers import Done, Pending, TierBackend

__all__ = ["TensorStore", "StoredTensor"]

log = logging.getLogger(__name__)
_ORDER = (Tier.DEVICE, Tier.HOST, Tier.NVME)  # fastest first


@dataclass(eq=False)
class _Copy:
    tier: Tier
    state: Residency = Residency.ABSENT
    slot: Any = None
    stage: HostBuffer | None = None  # host bounce buffer of a transfer between two non-host tiers
    valid: bool = False  # holds the newest bytes
    dirty: bool = False  # holds bytes newer than the home copy
    readers: int = 0  # transfers reading from this slot right now
    drop_when_idle: bool = False
    error: BaseException | None = None
    priority: int = 1
    version: int = 0  # the record's version when the load into this copy started


@dataclass(eq=False)
class StoredTensor:
    """The store's record of one tensor: its metadata and a copy per tier."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    home: Tier
    copies: dict[Tier, _Copy] = field(default_factory=dict)
    lost: BaseException | None = None  # set when no valid copy survived a failure
    version: int = 0  # bumped by mark_dirty; a write-back only cleans the version it wrote

    def copy(self, tier: Tier) -> _Copy:
        if tier not in self.copies:
            self.copies[tier] = _Copy(tier)
        return self.copies[tier]

    def state(self, tier: Tier) -> Residency:
        copy = self.copies.get(tier)
        return copy.state if copy is not None else Residency.ABSENT


class TensorStore:
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
        self._queues: dict[Tier, list[tuple[StoredTensor, _Copy]]] = {t: [] for t in self.tiers}
        self._cond = threading.Condition(threading.RLock())
        self._in_flight = 0
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
        home = Tier.parse(tier) if tier is not None else [t for t in _ORDER if t in self.tiers][-1]
        backend = self._backend(home)
        source = _as_bytes(tensor)
        record = StoredTensor(key, tensor.dtype, tuple(tensor.shape), source.numel(), home)
        with DEFER, self._cond:
            self._check_open()
            if key in self._tensors:
                self._delete(self._tensors[key])
            self._check_fits(record, home)
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

        completion, interrupt = _start(start, f"put of {key!r}")
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
                        raise self._stuck_error(record, tier)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"tensor {key!r} not resident in {tier.value} after {timeout}s")
                _wait(self._cond, remaining)
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
            self._backend(tier).fence(copy.slot)
            for other in list(record.copies.values()):
                if other is copy:
                    continue
                other.valid = False
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

    def read_copy(self, key: str) -> torch.Tensor:
        """A copy of ``key``'s current bytes in ordinary host memory. A tensor resting in a
        slower tier is fetched into the HOST tier for this, and that copy dropped again."""
        with DEFER, self._cond:
            home = self._record(key).home
        if home is not Tier.NVME:
            return self.wait(key, home).to("cpu", copy=True)
        self.fetch(key, Tier.HOST)
        out = self.wait(key, Tier.HOST).clone()
        self.evict(key, Tier.HOST)
        return out

    def read_into(self, key: str, dest: torch.Tensor, *, priority: int = 1) -> Any:
        """Start copying ``key``'s current bytes into ``dest`` (a contiguous uint8 host
        tensor of at least ``nbytes``, page aligned for a direct read); returns a completion
        (``wait()`` raises the transfer's error). The bytes come from the fastest copy that
        holds the newest version, read in place: no copy is made in any tier, so this needs
        no budget, and that copy cannot be dropped until the transfer ends."""
        with DEFER, self._cond:
            record = self._record(key)
            if record.lost is not None:
                raise _lost_error(record) from record.lost
            if dest.numel() < record.nbytes:
                raise ValueError(f"read_into({key!r}): destination holds {dest.numel()} bytes, "
                                 f"the tensor {record.nbytes}")
            while True:
                source = self._source(record, exclude=None)
                if source is not None:
                    break
                if not any(c.state is Residency.LOADING for c in record.copies.values()):
                    raise StoreError(f"tensor {key!r} has no copy holding its newest bytes")
                _wait(self._cond)
            if record.nbytes == 0:
                return Done()
            source.readers += 1
            self._in_flight += 1
            backend = self.tiers[source.tier]
        completion, interrupt = _start(lambda: backend.read_into(source.slot, dest, record.nbytes, priority=priority),
                                       f"read_into of {key!r}")
        done = Pending()

        def finished(c: Any) -> None:
            with DEFER, self._cond:
                self._in_flight -= 1
                self._reader_done(record, source)
                self._pump_all()
                self._cond.notify_all()
            done._finish(c.exception())

        completion.add_done_callback(finished)
        if interrupt is not None:
            raise interrupt
        return done

    def borrow_host(self, key: str) -> tuple[torch.Tensor, Any] | None:
        """``(view, release)`` of ``key``'s newest bytes when a copy holding them is in host
        memory (a HOST slot, or a DEVICE slot on a CPU device), else None. The copy is held
        (not dropped, its slot not reused) until ``release()`` is called; the caller must
        not change it. Lets a writer send resting bytes to a file without copying them."""
        with DEFER, self._cond:
            record = self._record(key)
            source = self._source(record, exclude=None)
            if source is None or record.nbytes == 0 or not self.tiers[source.tier].addressable:
                return None
            source.readers += 1
            view = self.tiers[source.tier].tensor(source.slot)[: record.nbytes]

        def release() -> None:
            with DEFER, self._cond:
                self._reader_done(record, source)
                self._pump_all()
                self._cond.notify_all()

        return view, release

    def map_view(self, key: str) -> tuple[torch.Tensor, Any] | None:
        """``(view, release)``: ``key``'s bytes seen in place through the NVMe tier's file
        mapping (``io_backend="mmap"``), when that copy holds the newest bytes and no other
        copy does; else None. No copy is made: pages come from the page cache (or the disk,
        on first touch). The copy is held (not rewritten, not freed) until ``release()``;
        the caller must not write the view. A CPU device computes on such views directly."""
        with DEFER, self._cond:
            record = self._record(key)
            nvme = record.copies.get(Tier.NVME)
            backend = self.tiers.get(Tier.NVME)
            if nvme is None or not hasattr(backend, "view") or record.nbytes == 0 \
                    or self._source(record, exclude=None) is not nvme or nvme.state is not Residency.RESIDENT:
                return None
            view = backend.view(nvme.slot, record.nbytes)
            nvme.readers += 1

        def release() -> None:
            with DEFER, self._cond:
                self._reader_done(record, nvme)
                self._pump_all()
                self._cond.notify_all()

        return view, release

    def advise(self, key: str) -> None:
        """Ask the NVMe tier to start reading ``key`` into the page cache (``io_backend="mmap"``;
        a no-op otherwise): the prefetch of :meth:`map_view`."""
        with DEFER, self._cond:
            record = self._record(key)
            nvme = record.copies.get(Tier.NVME)
            backend = self.tiers.get(Tier.NVME)
            if nvme is None or not hasattr(backend, "advise") or nvme.state is not Residency.RESIDENT:
                return
            backend.advise(nvme.slot, record.nbytes)

    def overwrite_in_place(self, key: str) -> tuple[torch.Tensor, Any] | None:
        """``(view, done)`` of ``key``'s home copy when it rests in host memory (a HOST
        slot, or a DEVICE slot on a CPU device), else None. Other copies are dropped and
        transfers touching the home copy waited for; the caller writes the new bytes into
        ``view`` and calls ``done()``. Lets a reader fill resting bytes from a file
        without a second copy."""
        with DEFER, self._cond:
            record = self._record(key)
            home = record.copies.get(record.home)
            if not self.tiers[record.home].addressable or record.nbytes == 0 or home is None:
                return None
            busy = (Residency.LOADING, Residency.STORING)
            while any(c.state in busy for c in record.copies.values()) or home.readers:
                _wait(self._cond)
            if home.state is not Residency.RESIDENT:
                return None
            for other in list(record.copies.values()):
                if other is not home and other.state is Residency.RESIDENT:
                    other.valid = False
                    self._drop(record, other)
                elif other is not home and other.state is Residency.QUEUED:
                    self._queues[other.tier].remove((record, other))
                    self._move(record, other, Residency.ABSENT)
                    self._release(record, other)
            home.readers += 1  # nothing frees or reuses the slot while the caller writes
            record.version += 1
            view = self.tiers[record.home].tensor(home.slot)[: record.nbytes]

        def done() -> None:
            with DEFER, self._cond:
                home.valid, home.dirty = True, False
                self._reader_done(record, home)
                self._pump_all()
                self._cond.notify_all()

        return view, done

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

    # ------------------------------------------------------------------------------------
    # transitions (all called with self._cond held)
    # ------------------------------------------------------------------------------------
    def _move(self, record: StoredTensor, copy: _Copy, new: Residency) -> None:
        check_transition(record.key, copy.tier, copy.state, new)
        copy.state = new
        self._cond.notify_all()

    def _fetch(self, record: StoredTensor, tier: Tier, priority: int) -> None:
        self._check_open()
        self._backend(tier)  # raises for a tier this store does not have
        self.fetches += 1
        if record.lost is not None:
            raise _lost_error(record) from record.lost
        copy = record.copy(tier)
        if copy.state is Residency.STORING:  # being dropped: keep it instead
            copy.drop_when_idle = False
            self._move(record, copy, Residency.RESIDENT)
        if copy.state is not Residency.ABSENT:
            self.fetch_hits += 1
            copy.drop_when_idle = False
            copy.priority = min(copy.priority, priority)
            return
        self._check_fits(record, tier)
        copy.priority = priority
        copy.error = None  # a new fetch: the error of an earlier one nobody waited for is stale
        if record.nbytes == 0:
            self._move(record, copy, Residency.RESIDENT)
            copy.valid = True
            return
        self._move(record, copy, Residency.QUEUED)
        self._queues[tier].append((record, copy))
        self._pump(tier)

    def _pump(self, tier: Tier) -> None:
        """Start queued fetches of ``tier`` in order while space allows."""
        queue = self._queues[tier]
        while queue:
            record, copy = queue[0]
            source = self._source(record, exclude=copy)
            if source is None:  # the newest bytes are still on their way somewhere
                return
            if not self._reserve(record, copy, source):
                return
            queue.pop(0)
            self._start_load(record, copy, source)

    def _reserve(self, record: StoredTensor, copy: _Copy, source: _Copy) -> bool:
        backend = self.tiers[copy.tier]
        needs_stage = not backend.addressable and not self.tiers[source.tier].addressable
        slot = backend.allocate(record.nbytes)
        if slot is None:
            return False
        if needs_stage:
            copy.stage = self.staging.try_acquire(record.nbytes)
            if copy.stage is None:
                backend.free(slot)
                return False
        copy.slot = slot
        return True

    def _reserve_blocking(self, record: StoredTensor, backend: TierBackend | None, *, stage: bool) -> Any:
        """A slot in ``backend`` (or a staging buffer), waiting for in-flight work to free room."""
        while True:
            got = self.staging.try_acquire(record.nbytes) if stage else backend.allocate(record.nbytes)
            if got is not None:
                return got
            if self._in_flight == 0:
                raise self._stuck_error(record, Tier.HOST if stage else backend.tier, staging=stage)
            _wait(self._cond)

    def _start_load(self, record: StoredTensor, copy: _Copy, source: _Copy) -> None:
        copy.version = record.version
        self._move(record, copy, Residency.LOADING)
        self._in_flight += 1
        source.readers += 1
        completion, interrupt = _start(lambda: self._transfer(record, source, copy, copy.priority),
                                       f"load of {record.key!r}")
        self._trace(completion, "load", record, source.tier, copy.tier)
        completion.add_done_callback(lambda c: self._loaded(record, copy, source, c))
        if interrupt is not None:
            raise interrupt

    def _write_home(self, record: StoredTensor, copy: _Copy) -> None:
        home = record.copies[record.home]
        if home.stage is None and not self.tiers[home.tier].addressable \
                and not self.tiers[copy.tier].addressable:
            home.stage = self._reserve_blocking(record, None, stage=True)
        self._move(record, copy, Residency.STORING)
        self._in_flight += 1
        copy.readers += 1
        version = record.version
        completion, interrupt = _start(lambda: self._transfer(record, copy, home, priority=1),
                                       f"write-back of {record.key!r}")
        self._trace(completion, "store", record, copy.tier, home.tier)
        completion.add_done_callback(lambda c: self._stored(record, copy, home, version, c))
        if interrupt is not None:
            raise interrupt

    def _transfer(self, record: StoredTensor, source: _Copy, dest: _Copy, priority: int) -> Any:
        src, dst, n = self.tiers[source.tier], self.tiers[dest.tier], record.nbytes
        if dst.addressable:
            return src.read_into(source.slot, dst.tensor(dest.slot), n, priority=priority)
        if src.addressable:
            return dst.write_from(dest.slot, src.tensor(source.slot), n, priority=priority)
        first = src.read_into(source.slot, dest.stage.bytes, n, priority=priority)
        return _Chained(first, lambda: dst.write_from(dest.slot, dest.stage.bytes, n, priority=priority))

    def _trace(self, completion: Any, kind: str, record: StoredTensor, source: Tier | None, dest: Tier) -> None:
        """With a tracer: the transfer as an async span from now to its completion."""
        tracer = self.tracer
        if tracer is None:
            return
        name = f"{kind} {record.key}"
        args = {"bytes": record.nbytes, "to": dest.name.lower()}
        if source is not None:
            args["from"] = source.name.lower()
        # into the compute tier: a parameter fetch (what prefetching should hide); else a
        # transfer between the resting tiers (write-backs, optimizer states)
        cat = "fetch" if dest is Tier.DEVICE and kind == "load" else "transfer"
        ident = tracer.begin(name, cat, args)
        completion.add_done_callback(lambda c: tracer.end(ident, name, cat))

    # -- completions (engine worker threads, CUDA event thread, or inline) ----------------
    def _loaded(self, record: StoredTensor, copy: _Copy, source: _Copy | None, completion: Any) -> None:
        error = completion.exception()
        with DEFER, self._cond:
            self._in_flight -= 1
            self._release_stage(copy)
            if source is not None:
                self._reader_done(record, source)
            if error is None and source is not None and copy.version != record.version:
                # another copy was changed in place (mark_dirty) while this one loaded: its
                # bytes are stale. Load it again from the newest copy, unless nobody wants it
                self._move(record, copy, Residency.ABSENT)
                self._release(record, copy)
                if copy.drop_when_idle:
                    copy.drop_when_idle = False
                else:
                    self._move(record, copy, Residency.QUEUED)
                    self._queues[copy.tier].append((record, copy))
            elif error is None:
                self._move(record, copy, Residency.RESIDENT)
                copy.valid = True
                if copy.drop_when_idle:
                    copy.drop_when_idle = False
                    self._drop(record, copy)
            else:
                self._move(record, copy, Residency.ABSENT)
                self._release(record, copy)
                if source is None:  # a put: its bytes existed nowhere else
                    record.lost = error
                if source is None or not isinstance(error, TransferInterrupted):
                    copy.error = error  # (an interrupted fetch is simply fetched again)
            self._pump_all()

    def _stored(self, record: StoredTensor, copy: _Copy, home: _Copy, version: int, completion: Any) -> None:
        error = completion.exception()
        with DEFER, self._cond:
            self._in_flight -= 1
            self._release_stage(home)
            copy.readers -= 1
            if error is not None:
                if not isinstance(error, TransferInterrupted):
                    copy.error = error  # the bytes are still here; raised at the next wait()
                if copy.state is Residency.STORING:
                    self._move(record, copy, Residency.RESIDENT)
            elif version == record.version:  # else the copy changed again meanwhile: still dirty
                home.valid, copy.dirty = True, False
                if copy.state is Residency.STORING:
                    self._move(record, copy, Residency.RESIDENT)
                    self._drop(record, copy)
            if error is None and not copy.dirty and copy.readers == 0 and copy.drop_when_idle \
                    and copy.state is Residency.RESIDENT:
                # revived by a fetch while it was written, then evicted: the eviction waited
                # for this write (a reader); its bytes are home now, so it goes
                copy.drop_when_idle = False
                self._drop(record, copy)
            self._pump_all()

    def _reader_done(self, record: StoredTensor, source: _Copy) -> None:
        source.readers -= 1
        if source.readers == 0 and source.drop_when_idle and source.state is Residency.RESIDENT:
            source.drop_when_idle = False
            self._drop(record, source)

    def _drop(self, record: StoredTensor, copy: _Copy) -> None:
        if copy.readers > 0:
            copy.drop_when_idle = True
            return
        self._move(record, copy, Residency.ABSENT)
        self._release(record, copy)
        self._pump_all()

    def _release(self, record: StoredTensor, copy: _Copy) -> None:
        if copy.slot is not None:
            self.tiers[copy.tier].free(copy.slot)
            copy.slot = None
        self._release_stage(copy)
        copy.valid = copy.dirty = False

    def _release_stage(self, copy: _Copy) -> None:
        if copy.stage is not None:
            self.staging.release(copy.stage)
            copy.stage = None

    def _pump_all(self) -> None:
        for tier, queue in self._queues.items():
            if queue:
                self._pump(tier)

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
        self._pump_all()

    # -- helpers --------------------------------------------------------------------------
    def _source(self, record: StoredTensor, exclude: _Copy) -> _Copy | None:
        """The fastest copy holding the newest bytes, or None if they are still in flight."""
        for tier in _ORDER:
            copy = record.copies.get(tier)
            if copy is not None and copy is not exclude and copy.valid \
                    and copy.state in (Residency.RESIDENT, Residency.STORING):
                return copy
        return None

    def _view(self, record: StoredTensor, copy: _Copy) -> torch.Tensor | None:
        backend = self.tiers[copy.tier]
        if not backend.addressable and copy.tier is not Tier.DEVICE:
            return None
        if record.nbytes == 0:
            device = self.device if copy.tier is Tier.DEVICE else torch.device("cpu")
            return torch.empty(record.shape, dtype=record.dtype, device=device)
        backend.consume(copy.slot)
        flat = backend.tensor(copy.slot)[: record.nbytes]
        return flat.view(record.dtype).view(record.shape)

    def _raise_error(self, record: StoredTensor, copy: _Copy) -> None:
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

    def _check_fits(self, record: StoredTensor, tier: Tier) -> None:
        backend = self._backend(tier)
        size = backend.slot_size(record.nbytes) if record.nbytes else 0
        if size > backend.budget:
            raise BudgetError(
                f"tensor {record.key!r} needs {size} bytes in the {tier.value} tier, whose whole "
                f"budget is {backend.budget} bytes: raise the {tier.value} budget or split the tensor")

    def _stuck_error(self, record: StoredTensor, tier: Tier, *, staging: bool = False) -> BudgetError:
        what = "host staging buffers" if staging else f"the {tier.value} tier"
        holders = sorted(((c.state.value, r.key) for r in self._tensors.values()
                          for c in r.copies.values() if c.tier is tier and c.slot is not None))[:8]
        backend = self.tiers.get(tier)
        used = f"{backend.used_bytes} of {backend.budget} bytes held" if backend else ""
        return BudgetError(
            f"tensor {record.key!r} ({record.nbytes} bytes) waits for room in {what} ({used}, by "
            f"{holders}) and nothing in flight will free any: evict() tensors first or raise "
            f"the {tier.value} budget")


class _Chained(Pending):
    """Completion of two transfers in sequence (disk -> staging -> device)."""

    def __init__(self, first: Any, start_second: Any):
        super().__init__()
        first.add_done_callback(lambda c: self._after_first(c, start_second))

    def _after_first(self, first: Any, start_second: Any) -> None:
        if first.exception() is not None:
            self._finish(first.exception())
            return
        try:
            second = start_second()
        except Exception as err:
            self._finish(err)
            return
        second.add_done_callback(lambda c: self._finish(c.exception()))


def _lost_error(record: StoredTensor) -> Exception:
    """What to raise for a tensor whose bytes no copy holds: an I/O error keeps its class
    (a DiskFullError stays one), anything else becomes a StoreError."""
    context = f"tensor {record.key!r} is lost"
    fix = "Its bytes were never stored: put it again (a wrapped model: load a checkpoint)"
    if isinstance(record.lost, OffloadIOError):
        return record.lost.with_context(context, fix)
    return StoreError(f"{context}: {record.lost}. {fix}")


def _start(start: Callable[[], Any], what: str) -> tuple[Any, BaseException | None]:
    """Start a transfer; returns its completion and, when a KeyboardInterrupt (or another
    BaseException) cut the start short, that exception for the caller to raise once the
    completion's callback is attached, so that the store's books stay balanced."""
    try:
        return start(), None
    except Exception as err:  # a transfer that could not even start fails like one that did
        return Done(err), None
    except BaseException as err:
        return Done(TransferInterrupted(f"the {what} was interrupted ({type(err).__name__})")), err


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s bytes (copied to contiguous when needed)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


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
