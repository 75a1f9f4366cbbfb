"""Moving a stored tensor's bytes between tiers: the route a copy is made by, the room
reserved for it, the transfer started, and its completion booked.

Part of :class:`~offload.store.TensorStore` (a mixin, so that one object keeps owning
the records, the lock and the books). Everything here runs with the store's lock held,
but the completions, which take it: they come from engine worker threads, the CUDA event
thread, or inline.
"""

from __future__ import annotations

from typing import Any, Callable

from .._signals import DEFER, wait as _wait
from ..io import BudgetError
from ._records import FASTEST_FIRST, StoredTensor, TierCopy, lost_error
from ._state import Residency, Tier, TransferInterrupted
from ._tiers import Done, Pending, TierBackend

__all__ = ["Transfers", "start_transfer"]


class Transfers:
    """Routing, reservations, transfers and completions of a TensorStore."""

    def wait_stored(self, key: str, tier: Tier | str) -> None:
        """Block while ``key``'s copy in ``tier`` is being written home (``evict`` of a
        changed copy returns at once and frees the copy's room when the write lands); raise
        that write's error. Lets a caller bound how much memory its write-backs hold."""
        tier = Tier.parse(tier)
        with DEFER, self._cond:
            self._check_open()
            record = self._record(key)
            copy = record.copies.get(tier)
            while copy is not None and copy.state is Residency.STORING:
                _wait(self._cond, None)  # (a write in flight always completes: the engine reports errors too)
                self._check_open()
            if copy is not None:
                self._raise_error(record, copy)

    def wait_unread(self, key: str, tier: Tier | str) -> None:
        """Block while a transfer reads ``key``'s copy in ``tier`` (a fetch into another tier,
        a write home), for a caller about to change that copy in place. Changed under a
        transfer, the copy made would be dropped by its version after the transfer was
        paid for; and on a device a copy engine would be reading memory the host writes.
        (A caller's borrow also counts as a reader: with no transfer in flight, none is
        waited for.)"""
        tier = Tier.parse(tier)
        with DEFER, self._cond:
            self._check_open()
            copy = self._record(key).copies.get(tier)
            while copy is not None and copy.readers and self._in_flight:
                _wait(self._cond, None)  # (a transfer in flight always completes)
                self._check_open()

    # -- issuing (lock held) --------------------------------------------------------------
    def _fetch(self, record: StoredTensor, tier: Tier, priority: int) -> None:
        self._check_open()
        self._backend(tier)  # raises for a tier this store does not have
        self.fetches += 1
        if record.lost is not None:
            raise lost_error(record) from record.lost
        copy = record.copy(tier)
        while copy.state is Residency.STORING and not copy.valid:  # stale: dropped when its write lands
            _wait(self._cond)
            self._check_open()
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

    def _reserve(self, record: StoredTensor, copy: TierCopy, source: TierCopy) -> bool:
        backend = self.tiers[copy.tier]
        needs_stage = not backend.addressable and not self.tiers[source.tier].addressable
        copy.short_of_staging = False
        slot = backend.allocate(record.nbytes)
        if slot is None:
            return False
        if needs_stage:
            copy.stage = self.staging.try_acquire(record.nbytes)
            if copy.stage is None:
                backend.free(slot)
                copy.short_of_staging = True
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
                if self._shed_for(backend.tier if backend else Tier.HOST, stage, record.nbytes):
                    continue  # (writes started: their landing frees the room)
                raise self._stuck_error(record, Tier.HOST if stage else backend.tier, staging=stage)
            _wait(self._cond)

    def _shed_for(self, tier: Tier, staging: bool, nbytes: int) -> bool:
        """Nothing in flight frees the room a transfer waits for: where that room is host
        memory, start writing home copies held back there (``_behind``); whether any went."""
        return (staging or tier is Tier.HOST) and bool(self._behind) and self.shed_behind(nbytes) > 0

    def _start_load(self, record: StoredTensor, copy: TierCopy, source: TierCopy) -> None:
        copy.version = record.version
        self._move(record, copy, Residency.LOADING)
        self._in_flight += 1
        source.readers += 1
        completion, interrupt = start_transfer(lambda: self._transfer(record, source, copy, copy.priority),
                                               f"load of {record.key!r}")
        self._trace(completion, "load", record, source.tier, copy.tier)
        completion.add_done_callback(lambda c: self._loaded(record, copy, source, c))
        if interrupt is not None:
            raise interrupt

    def _write_home(self, record: StoredTensor, copy: TierCopy) -> None:
        if record.writing:
            # one write into the home at a time: an earlier one, of bytes another copy has
            # since replaced, must not land last. This one starts when it lands (_stored)
            self._move(record, copy, Residency.STORING)
            earlier, record.next_write = record.next_write, copy
            if earlier is not None and earlier is not copy:  # (replaced before it started)
                self._move(record, earlier, Residency.RESIDENT)
                self._drop(record, earlier)
            return
        self._start_write(record, copy, blocking=True)

    def _start_write(self, record: StoredTensor, copy: TierCopy, *, blocking: bool) -> bool:
        """Start writing ``copy`` home. What it needs is reserved before the copy becomes
        STORING, so a refusal leaves it resident and dirty. Not ``blocking`` (a completion
        callback, which must not wait): False, nothing changed, if no staging buffer is free."""
        self._move_out_of_checkpoint(record)
        home = record.copies[record.home]
        if home.stage is None and not self.tiers[home.tier].addressable \
                and not self.tiers[copy.tier].addressable:
            stage = self._reserve_blocking(record, None, stage=True) if blocking else \
                self.staging.try_acquire(record.nbytes)
            if stage is None:
                return False
            home.stage = stage
        if copy.state is not Residency.STORING:
            self._move(record, copy, Residency.STORING)
        self._in_flight += 1
        record.writing = True
        copy.readers += 1
        version = record.version
        completion, interrupt = start_transfer(lambda: self._transfer(record, copy, home, priority=1),
                                               f"write-back of {record.key!r}")
        self._trace(completion, "store", record, copy.tier, home.tier)
        completion.add_done_callback(lambda c: self._stored(record, copy, home, version, c))
        if interrupt is not None:
            raise interrupt
        return True

    def _transfer(self, record: StoredTensor, source: TierCopy, dest: TierCopy, priority: int) -> Any:
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
    def _loaded(self, record: StoredTensor, copy: TierCopy, source: TierCopy | None, completion: Any) -> None:
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
            self._cond.notify_all()  # (the reader and in-flight counts moved: see _stored)

    def _stored(self, record: StoredTensor, copy: TierCopy, home: TierCopy, version: int, completion: Any) -> None:
        error = completion.exception()
        with DEFER, self._cond:
            self._in_flight -= 1
            record.writing = False
            copy.readers -= 1
            if not copy.valid and copy.state is Residency.STORING:
                # another copy was changed (mark_dirty) while this one was written: its bytes,
                # and the write's, are stale; the changed copy writes home in its turn
                self._move(record, copy, Residency.RESIDENT)
                self._drop(record, copy)
            elif error is not None:
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
            self._next_write(record, home)  # (which takes over the staging buffer, if any)
            if not record.writing:
                self._release_stage(home)
            self._pump_all()
            # (the write may end with no state change: a copy revived while it was written
            # stays resident; wait_unread() and wait_stored() wait on readers and in-flight
            # counts, and slept on forever)
            self._cond.notify_all()

    def _next_write(self, record: StoredTensor, home: TierCopy) -> None:
        """Start the write that waited for the one that landed, if it is still needed (lock
        held; from a completion too, so it never waits: without a staging buffer free, it
        waits in ``_writes_waiting`` for a later completion or release)."""
        copy, record.next_write = record.next_write, None
        self._writes_waiting.discard(record)
        if copy is None or copy.state is not Residency.STORING:
            return  # (none, or revived by a fetch meanwhile: dirty and resident)
        if not (copy.valid and copy.dirty and not home.valid):  # home already (the write that landed), or stale
            self._move(record, copy, Residency.RESIDENT)
            self._drop(record, copy)
        elif not self._start_write(record, copy, blocking=False):
            if self._in_flight:  # a transfer in flight may free one
                record.next_write = copy
                self._writes_waiting.add(record)
            else:  # none will: kept resident and dirty, the refusal raised at its next wait
                self._move(record, copy, Residency.RESIDENT)
                copy.error = self._stuck_error(record, Tier.HOST, staging=True)

    def _reader_done(self, record: StoredTensor, source: TierCopy) -> None:
        source.readers -= 1
        if source.readers == 0 and source.drop_when_idle and source.state is Residency.RESIDENT:
            source.drop_when_idle = False
            self._drop(record, source)

    def _drop(self, record: StoredTensor, copy: TierCopy) -> None:
        if copy.readers > 0:
            copy.drop_when_idle = True
            return
        self._move(record, copy, Residency.ABSENT)
        self._release(record, copy)
        self._pump_all()

    def _release(self, record: StoredTensor, copy: TierCopy) -> None:
        if copy.slot is not None:
            self.tiers[copy.tier].free(copy.slot)
            copy.slot = None
        self._release_stage(copy)
        copy.valid = copy.dirty = False

    def _release_stage(self, copy: TierCopy) -> None:
        if copy.stage is not None:
            self.staging.release(copy.stage)
            copy.stage = None

    def _pump_all(self) -> None:
        for record in list(self._writes_waiting):
            if not record.writing:
                self._next_write(record, record.copies[record.home])
        for tier, queue in self._queues.items():
            if queue:
                self._pump(tier)

    # -- route and room -------------------------------------------------------------------
    def _source(self, record: StoredTensor, exclude: TierCopy) -> TierCopy | None:
        """The fastest copy holding the newest bytes, or None if they are still in flight."""
        for tier in FASTEST_FIRST:
            copy = record.copies.get(tier)
            if copy is not None and copy is not exclude and copy.valid \
                    and copy.state in (Residency.RESIDENT, Residency.STORING):
                return copy
        return None

    def _check_fits(self, record: StoredTensor, tier: Tier) -> None:
        backend = self._backend(tier)
        size = backend.slot_size(record.nbytes) if record.nbytes else 0
        if size > backend.budget:
            raise BudgetError(
                f"tensor {record.key!r} needs {size} bytes in the {tier.value} tier, whose whole "
                f"budget is {backend.budget} bytes: raise the {tier.value} budget or split the tensor")

    def _stuck_error(self, record: StoredTensor, tier: Tier, *, staging: bool = False) -> BudgetError:
        """``staging``: the room missing is the host staging buffers' (a transfer between two
        tiers that are not host memory bounces through them); the error's ``short_of`` says
        which budget is short."""
        if staging:
            error = BudgetError(
                f"tensor {record.key!r} ({record.nbytes} bytes) waits for a host staging buffer (a transfer "
                f"between tiers outside host memory passes through one; {self.staging.in_use_bytes} of "
                f"{self.staging.budget} bytes of the host pool in use) and nothing in flight will free any: "
                f"raise {self.budget_names[Tier.HOST]} above {self.staging.in_use_bytes + record.nbytes} bytes, "
                "with room to spare: what else the run holds grows with it")
            error.short_of = Tier.HOST
            return error
        holders = sorted(((c.state.value, r.key) for r in self._tensors.values()
                          for c in r.copies.values() if c.tier is tier and c.slot is not None))[:8]
        backend = self.tiers.get(tier)
        # (host memory: the pool's count, which also holds buffers lent outside the store's copies)
        held = self.staging.in_use_bytes if tier is Tier.HOST else backend.used_bytes if backend else 0
        used = f"{held} of {backend.budget} bytes held" if backend else ""
        need = held + backend.slot_size(record.nbytes) if backend else record.nbytes
        error = BudgetError(
            f"tensor {record.key!r} ({record.nbytes} bytes) waits for room in the {tier.value} tier ({used}, by "
            f"{holders}) and nothing in flight will free any: raise "
            f"{self.budget_names.get(tier, f'the {tier.value} budget')} "
            f"above {need} bytes, with room to spare (what else the run holds grows with it); using the store "
            "directly, evict() tensors first")
        error.short_of = tier
        return error


BUDGET_NAMES = {Tier.HOST: "host_budget (OffloadConfig)", Tier.DEVICE: "device_budget (OffloadConfig)"}


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


def start_transfer(start: Callable[[], Any], what: str) -> tuple[Any, BaseException | None]:
    """Start a transfer; returns its completion and, when a KeyboardInterrupt (or another
    BaseException) cut the start short, that exception for the caller to raise once the
    completion's callback is attached, so that the store's books stay balanced."""
    try:
        return start(), None
    except Exception as err:  # a transfer that could not even start fails like one that did
        return Done(err), None
    except BaseException as err:
        return Done(TransferInterrupted(f"the {what} was interrupted ({type(err).__name__})")), err
