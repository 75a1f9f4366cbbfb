"""The coordinator: which parameter groups are materialized on the device, and which to fetch next.

The order in which groups are acquired is recorded in the first pass of each kind
(``_schedule``); from then on each acquisition fetches ahead the groups that follow in that
order (wrapping into the next pass) while the bytes read ahead stay within
``prefetch_limit``. A released group whose next use falls inside that window stays on the
device, and after the first recorded pass the groups used most are kept on the device
across passes within ``cache_bytes``.

Each group's state (``_state.GroupState``) changes in one place, ``_move``, which checks
the transition and keeps the indexes of the states (``ahead``, in order, and ``parked``).
How stored bytes become a device buffer is the materializer's (``_materializer``), chosen
once at ``wrap``; the coordinator calls it without asking which mode it serves.

Materializing a group points each of its parameters' ``.data`` at a view of the group's
flat device buffer; releasing points it back at a placeholder: a stride-0 tensor of the
right shape holding NaN (or 0 for integer parameters), so code that reads shapes outside
forward works. Uses of a released parameter go through demand fetch (``_demand``), which
fetches the group for them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .._memory import HEAP_PEAK
from .._signals import DEFER
from ..io import BudgetError
from ..store import TensorStore, Tier
from .._autograd import in_backward
from ._groups import ParamGroup, Placeholders, point, versions
from ._materializer import Materializer
from ._pending import PendingWrites
from ._replaced import adopt_replaced, replaced_slots, settle_replaced_before_write
from ._schedule import Schedule, choose_cached
from ._sizing import no_room_error, remeasured
from ._state import Counts, GroupRecord, GroupState, check_transition

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)

_RELEASED, _AHEAD, _CACHED = GroupState.RELEASED, GroupState.AHEAD, GroupState.CACHED
_MATERIALIZED, _PARKED = GroupState.MATERIALIZED, GroupState.PARKED


class Coordinator:
    def __init__(self, store: TensorStore, groups: list[ParamGroup], materializer: Materializer, *,
                 device: torch.device, prefetch_limit: int, device_budget: int, cache_bytes: int | str = 0,
                 layout: Any = None):
        self.store, self.device, self.materializer = store, device, materializer
        self.groups = [g for g in groups if not g.resident]
        self.prefetch_limit, self.device_budget = prefetch_limit, device_budget
        self.cache_bytes = cache_bytes
        # what a pass needs besides the cache and the prefetch window: the resident groups
        # and the most groups held at once (offload.params._sizing.DeviceLayout)
        self.layout = layout
        if layout is not None:  # reused larger buffers only from the room the layout leaves
            store.tiers[Tier.DEVICE].limit_slack(layout.room(device_budget))
        self.records: dict[ParamGroup, GroupRecord] = {g: GroupRecord() for g in groups}
        self.schedule = Schedule()
        self.ahead: dict[ParamGroup, None] = {}  # the AHEAD groups, nearest use first
        self.ahead_bytes = 0
        self.parked: set[ParamGroup] = set()  # the PARKED groups
        self.cached: set[ParamGroup] = set()  # chosen to stay on the device across passes (CACHED once loaded)
        self.by_storage: dict[int, ParamGroup] = {}  # data_ptr of viewed buffers
        self.counts = Counts()
        self.tracer: Any = None  # an offload._trace.Tracer: compute and stall spans
        # the schedule as (event, group key, phase) tuples, when a list: tests switch it on
        # (tests/conftest.py, record_schedule); off, it costs one check per event
        self.schedule_log: list | None = None
        self.placeholder = Placeholders(device)  # what released parameters point at
        self.on_park: Any = None  # called when a group is parked (the hooks queue the end of backward)
        self.on_change: Any = None  # called with a group whose bytes the optimizer or a load replaces
        self.on_written: Any = None  # called with a group written in place while it was materialized
        # optimizers whose step owes groups new bytes (update during the next forward): a
        # group is written before it is materialized, and never read ahead while owed
        self.pending = PendingWrites()
        materializer.bind(self)

    @property
    def zero_copy(self) -> bool:
        """Whether parameters view the stored bytes in place (mapped views)."""
        return self.materializer.zero_copy

    # -- passes ------------------------------------------------------------------------------
    def begin_pass(self, key: str) -> None:
        """A new pass (the root module's forward) of kind ``key`` starts."""
        self.store.check_files()
        if key == "grad":  # (checkpointing recomputes only where there is a backward)
            self._check_layout()
        if self.schedule.is_open(key):
            return  # end_pass() already opened it and prefetched its start
        self._finish_pass()
        self.schedule.open(key)

    def end_pass(self) -> None:
        """The pass is over (end of an inference forward, or of backward): keep its order and
        start fetching the first groups of the next pass of the same kind."""
        key = self.schedule.ending()
        if key is None:
            return
        self._finish_pass()
        self.schedule.open(key)
        self._prefetch()

    def abandon_pass(self) -> None:
        """Drop the current pass without recording its (partial) order."""
        self.schedule.abandon()

    def _check_layout(self) -> None:
        """Activation checkpointing turned on since ``wrap`` keeps whole blocks' groups at
        once: measured again (a budget that no longer holds a pass refused here, before the
        pass), and the cache chosen again from the room left."""
        device = self.store.tiers[Tier.DEVICE]
        if self.layout is None or not remeasured(self.layout, device.slot_size, self.device_budget):
            return
        device.limit_slack(self.layout.room(self.device_budget))
        for group in self.cached:
            rec = self.records[group]
            if rec.state is _CACHED:
                self._move(group, rec, _RELEASED)
                self.materializer.evict(group)
        self.cached = set()

    def _finish_pass(self) -> None:
        recorded = self.schedule.finish()
        if recorded is not None and not self.cached and self.materializer.resident_cache:
            self._choose_cached(recorded)

    def _choose_cached(self, trace: list[ParamGroup]) -> None:
        device = self.store.tiers[Tier.DEVICE]
        chosen, total = choose_cached(trace, slot_size=device.slot_size, layout=self.layout,
                                      cache_bytes=self.cache_bytes, prefetch_limit=self.prefetch_limit,
                                      device_budget=self.device_budget)
        self.cached = set(chosen)
        if self.layout is not None:
            device.limit_slack(self.layout.room(self.device_budget) - total)
        if chosen:
            log.info("keeping %d parameter groups (%.1f MiB) resident across passes", len(chosen),
                     total / 2**20)

    # -- acquire / release ---------------------------------------------------------------------
    def acquire(self, group: ParamGroup, phase: str, *, record: bool = True) -> None:
        """Make ``group`` materialized for compute; called before the module runs.

        ``phase``: "forward", "backward" (released by ``release_backward`` at the latest) or
        "demand" (a use outside the group's module). ``record``: note the use in the
        pass's order (uses between passes are not)."""
        if self.pending:
            self.pending.ready(group)
        if group.resident:
            return
        HEAP_PEAK.sample()  # torch's tensors peak somewhere in the passes: look at each group
        with DEFER:  # Ctrl-C lands before or after this bookkeeping (or in a wait), not inside
            self._acquire(group, phase, record)

    def _acquire(self, group: ParamGroup, phase: str, record: bool = True) -> None:
        rec = self.records[group]
        if rec.state is _PARKED:  # held again: its buffer serves this use
            self._move(group, rec, _MATERIALIZED)
        if record:
            self._record(group, phase)
        else:
            self.log_event("acquire", group, phase)
        rec.refs += 1
        if phase == "backward":
            rec.backward_refs += 1
        if rec.state is not _MATERIALIZED:
            if phase == "demand":
                self.counts.demand_fetches += 1
            try:
                self._materialize(group, rec)
            except BaseException:  # not acquired: nothing will release it
                rec.refs -= 1
                if phase == "backward":
                    rec.backward_refs -= 1
                raise
        self._prefetch()
        self.materializer.after_acquire()
        self.log_event("ready", group, phase)  # compute of the module may start now
        if self.tracer is not None:
            rec.started.append((phase, self.tracer.now()))

    def _record(self, group: ParamGroup, phase: str) -> None:
        if self.schedule.current is None:  # a module called outside its root's forward (e.g. model.lm_head(x))
            self.begin_pass("direct")
        if self.schedule.record(group):  # the order changed: what was started ahead will not be used
            for other in list(self.ahead):
                self._drop_ahead(other)
            self.materializer.cancel_ahead()
        self.log_event("acquire", group, phase)

    def _materialize(self, group: ParamGroup, rec: GroupRecord) -> None:
        source = rec.state
        if source is _AHEAD:  # taken for this use (see _state)
            self._move(group, rec, _RELEASED)
        replaced = replaced_slots(group, self.placeholder)
        flat, rec.lease = self.materializer.materialize(group, source)
        self._move(group, rec, _MATERIALIZED)
        rec.flat = flat
        for slot in group.slots:
            point(slot.param, flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
        rec.versions = versions(group)
        self.by_storage[flat.untyped_storage().data_ptr()] = group
        if replaced:
            adopt_replaced(group, flat, replaced)
            self.note_written(group)

    def room_error(self, group: ParamGroup, err: BudgetError) -> BudgetError:
        """The store has no room for ``group`` at this point of the pass: the refusal."""
        held = [g for g, rec in self.records.items() if rec.state.viewed]
        return no_room_error(group, err, device=self.store.tiers[Tier.DEVICE], device_budget=self.device_budget,
                             held=held, parked=self.parked, layout=self.layout)

    def release(self, group: ParamGroup, phase: str) -> None:
        if group.resident:
            return
        with DEFER:
            self._release(group, phase)

    def _release(self, group: ParamGroup, phase: str) -> None:
        rec = self.records[group]
        if rec.refs == 0 or (phase == "backward" and rec.backward_refs == 0):
            return
        rec.refs -= 1
        if phase == "backward":
            rec.backward_refs -= 1
        self.log_event("release", group, phase)
        if self.tracer is not None and rec.started:
            began_phase, began = rec.started.pop()
            self.tracer.span(f"{began_phase} {group.key}", "compute", began, self.tracer.now(), "compute")
        if rec.refs == 0:
            if phase != "backward" and in_backward():
                self._move(group, rec, _PARKED)
                if self.on_park is not None:
                    self.on_park()
                return
            self._dematerialize(group, rec)

    def _dematerialize(self, group: ParamGroup, rec: GroupRecord) -> None:
        self._check_written(group, rec)
        self.by_storage.pop(rec.flat.untyped_storage().data_ptr(), None)
        rec.flat = None
        for slot in group.slots:
            point(slot.param, self.placeholder(slot.dtype, slot.shape))
        kept = self.materializer.give_back(group, rec)
        rec.lease = None
        if kept and group in self.cached:
            self._move(group, rec, _CACHED)  # stays on the device across passes
            return
        self._move(group, rec, _RELEASED)
        if not kept:
            return
        if group in self._window():
            self._move(group, rec, _AHEAD)  # keep the bytes on the device for the coming use
        else:
            self.materializer.evict(group)

    def _check_written(self, group: ParamGroup, rec: GroupRecord) -> None:
        """Code inside the group's module changed it in place (a view of a weight, or its
        ``.data``, which has a version counter of its own): keep the change (the device copy
        becomes the newest, written home when dropped) and say so."""
        certain = versions(group) != rec.versions
        changed = rec.maybe_written or certain
        rec.maybe_written = False
        if changed and self.materializer.keep_write(group, rec, certain):
            rec.written += 1
            if self.on_written is not None:
                self.on_written(group)

    def release_backward(self) -> None:
        """End of backward: release every group still held for it (and those parked)."""
        for group, rec in self.records.items():
            while rec.backward_refs:
                self.release(group, "backward")
        self.unpark()

    def unpark(self) -> None:
        """Release the groups parked during a backward that has ended."""
        for group in list(self.parked):
            with DEFER:
                self._dematerialize(group, self.records[group])

    def abandon_forward(self) -> None:
        """A forward was interrupted before its modules released their groups: release
        every acquisition that is not held for a backward, and forget its partial order."""
        for group, rec in self.records.items():
            while rec.refs > rec.backward_refs:
                self.release(group, "forward")
        self.abandon_pass()

    def release_all(self) -> None:
        self.unpark()
        self.materializer.cancel_ahead()
        for group, rec in self.records.items():
            if rec.refs:
                rec.refs = rec.backward_refs = 0
                self._dematerialize(group, rec)
        for group in list(self.ahead):
            self._drop_ahead(group)
        for group, rec in self.records.items():
            if rec.state is _CACHED:
                self._move(group, rec, _RELEASED)
                self.materializer.evict(group)
        self.cached = set()

    # -- what the rest of params asks --------------------------------------------------------------
    def flat_of(self, group: ParamGroup) -> torch.Tensor | None:
        """The device buffer ``group``'s parameters view now (None when released)."""
        return self.records[group].flat

    def in_use(self, group: ParamGroup) -> bool:
        """Whether a pass computes (or may still compute, parked) with ``group``'s bytes."""
        rec = self.records[group]
        return bool(rec.refs) or rec.state is _PARKED

    def forget(self, group: ParamGroup, *, replaced: str = "discard") -> None:
        """The optimizer is about to replace ``group``'s bytes in its home tier: drop what
        the coordinator holds of the old ones (a prefetch, a resident-cache copy)."""
        rec = self.records[group]
        if rec.state is _PARKED and not in_backward():  # left by a backward that never ended
            self.unpark()
        if self.in_use(group):
            raise RuntimeError(f"parameter group {group.key!r} is in use by a forward or backward "
                               "pass: call the optimizer's step() after backward() returns")
        settle_replaced_before_write(group, self.placeholder, replaced)
        self.materializer.cancel_ahead(group)
        if rec.state is not _RELEASED:  # (the write that follows replaces or invalidates its device copy)
            self._move(group, rec, _RELEASED)
        rec.written += 1
        if self.on_change is not None:
            self.on_change(group)

    def note_handed_out(self, group: ParamGroup) -> None:
        """A ``.data`` alias of the materialized ``group`` was handed out: in-place writes
        through it bump no counter, so its release keeps the bytes as written."""
        self.records[group].maybe_written = True

    def note_written(self, group: ParamGroup) -> None:
        """The caller changed ``group``'s materialized bytes in place: keep the change
        (copies taken before are stale; its release need not find the change again)."""
        rec = self.records[group]
        if rec.state.viewed:
            self.materializer.keep_write(group, rec, True)
        rec.written += 1
        if rec.flat is not None:
            rec.versions = versions(group)

    def note_updated(self, group: ParamGroup) -> None:
        """An optimizer updated the resident ``group`` where it rests: copies taken before are stale."""
        self.records[group].written += 1

    def written_version(self, group: ParamGroup) -> int:
        return self.records[group].written

    def resume_prefetch(self) -> None:
        """Fetch ahead again from the current position (after the optimizer's step)."""
        self._prefetch()

    # -- what the materializer asks --------------------------------------------------------------
    def make_room(self, nbytes: int) -> None:
        """A fetch for use comes first: drop the farthest read-aheads until ``nbytes`` fit."""
        size = self.store.tiers[Tier.DEVICE].slot_size(nbytes)
        while self.ahead and self.materializer.used_bytes() + size > self.device_budget:
            self._drop_ahead(next(reversed(self.ahead)))

    def note_read_ahead(self, group: ParamGroup) -> None:
        """The materializer fetched ``group`` ahead of its use on its own (a slice to gather)."""
        self._move(group, self.records[group], _AHEAD)

    def log_event(self, event: str, group: ParamGroup, phase: str) -> None:
        if self.schedule_log is not None:
            self.schedule_log.append((event, group.key, phase))

    # -- internals -----------------------------------------------------------------------------
    def _move(self, group: ParamGroup, rec: GroupRecord, new: GroupState) -> None:
        """The one place a group's state changes: checked, and the indexes kept."""
        old = rec.state
        check_transition(group.key, old, new)
        if old is _AHEAD:
            del self.ahead[group]
            self.ahead_bytes -= group.nbytes
        elif old is _PARKED:
            self.parked.discard(group)
        rec.state = new
        if new is _AHEAD:
            self.ahead[group] = None
            self.ahead_bytes += group.nbytes
        elif new is _PARKED:
            self.parked.add(group)

    def _drop_ahead(self, group: ParamGroup) -> None:
        self._move(group, self.records[group], _RELEASED)
        self.materializer.evict(group)

    def _window(self) -> list[ParamGroup]:
        """The nearest upcoming groups not on the device now, up to ``prefetch_limit`` bytes."""
        window: list[ParamGroup] = []
        total = 0
        for group in self.schedule.upcoming():
            if group in window or self.records[group].state.on_device:
                continue
            if self.pending and self.pending.stale(group):
                continue  # its new bytes are written at its use: read then
            if total + group.nbytes > self.prefetch_limit:
                break
            window.append(group)
            total += group.nbytes
        return window

    def _prefetch(self) -> None:
        # Groups read ahead stay until used even when the window moves past them (they are
        # in the recorded order, so they are needed soon); dropping and reading them again
        # would read the same bytes twice.
        candidates = [g for g in self._window() if g not in self.ahead]
        if not candidates:
            return
        for group in self.materializer.prefetch(candidates, self.prefetch_limit - self.ahead_bytes):
            self.log_event("fetch", group, "prefetch")
            self._move(group, self.records[group], _AHEAD)
