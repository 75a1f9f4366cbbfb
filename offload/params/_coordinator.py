"""The coordinator: which groups are materialized on the device, and which to fetch next.

It records the order in which groups are acquired during the first pass of each kind
("grad" for training steps, "nograd" for inference), and from then on, each time a group
is acquired, issues fetches for the groups that follow in that order (wrapping around to
the next pass) while the bytes fetched ahead stay within ``prefetch_limit``. If a pass
acquires groups in another order, it logs once, fetches on demand for the rest of that
pass, and keeps the new order for the next one.

Materializing a group points each of its parameters' ``.data`` at a view of the group's
flat device buffer; releasing points it back at a placeholder: a stride-0 tensor of the
right shape holding NaN (or 0 for integer parameters), so code that reads shapes outside
forward works. Uses of a released parameter go through demand fetch (``_demand``), which
fetches the group for them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .._signals import DEFER
from .._units import format_size
from ..io import BudgetError
from ..store import Residency, TensorStore, Tier
from ._gathering import Gathering
from ._groups import ParamGroup, point

__all__ = ["Coordinator", "graph_task", "in_backward", "refuse_copy"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Live:
    """Per-group runtime state."""

    refs: int = 0  # acquisitions not yet released
    flat: torch.Tensor | None = None  # uint8 device view while materialized
    backward_refs: int = 0  # of refs, those taken for backward
    release: Any = None  # with zero_copy: gives back the mapped view ``flat`` is
    gathered: Any = None  # with several ranks: the device slot the whole group was gathered into
    pending: Any = None  # with several ranks: (work, slot, tensor) of an all-gather issued ahead of use
    started: list = field(default_factory=list)  # with a tracer: (phase, time) per acquisition
    versions: tuple = ()  # its parameters' version counters when materialized (in-place writes bump them)
    maybe_written: bool = False  # a parameter's .data was handed out while materialized
    written: int = 0  # bumped by every write to the group's bytes (in place, optimizer, load)


@dataclass
class _Pass:
    key: str
    actual: list[ParamGroup] = field(default_factory=list)
    cursor: int = 0
    diverged: bool = False


def graph_task() -> int | None:
    """The running backward's graph task (-1 outside backward); None where torch has no such call."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    task = graph_task()
    return task is not None and task >= 0


class Coordinator(Gathering):
    def __init__(self, store: TensorStore, groups: list[ParamGroup], *, device: torch.device,
                 prefetch_limit: int, device_budget: int, cache_bytes: int | str = 0,
                 events: list | None = None, zero_copy: bool = False, partition: Any = None,
                 home: Tier | None = None, layout: Any = None):
        self.store, self.device = store, device
        # several ranks (offload.distributed): the store holds this rank's slice of each group
        # (key = the group's key); materializing all-gathers the whole group into a device
        # slot of its own, counted in the device budget, freed at release
        self.partition = partition
        self.home = home
        self.gather_seconds = 0.0  # waiting for all-gathers (issued at use, or ahead and not done)
        self.gathered_ahead = 0  # all-gathers issued ahead of use
        self.gather_over_budget_bytes = 0  # largest gathered group that the tier had no room for
        # a CPU device over io_backend="mmap": parameters are views of the mapped swap files
        # (no copy, no device budget); prefetching is a read-ahead advice to the kernel
        self.zero_copy = zero_copy
        self.groups = [g for g in groups if not g.resident]
        self.prefetch_limit, self.device_budget = prefetch_limit, device_budget
        self.cache_bytes = cache_bytes
        # what a pass needs besides the cache and the prefetch window: the resident groups
        # and the most groups held at once (offload.params._sizing.DeviceLayout)
        self.layout = layout
        if layout is not None:  # reused larger buffers only from the room the layout leaves
            store.tiers[Tier.DEVICE].limit_slack(layout.room(device_budget))
        self.cached: dict[ParamGroup, bool] = {}  # kept resident across passes -> loaded yet
        self.events = events  # when a list, every fetch/acquire/release is appended
        self.tracer: Any = None  # an offload._trace.Tracer: compute and stall spans
        self.live: dict[ParamGroup, _Live] = {g: _Live() for g in groups}
        self.by_storage: dict[int, ParamGroup] = {}  # data_ptr of materialized buffers
        self.traces: dict[str, list[ParamGroup]] = {}
        self.ahead: dict[ParamGroup, None] = {}  # fetched for later use, in order
        self.current: _Pass | None = None
        self.stall_seconds = 0.0
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self._warned: set[str] = set()
        self._placeholders: dict[tuple, torch.Tensor] = {}
        # groups a forward released while a backward runs (activation checkpointing
        # recomputes inside backward): their buffers stay until that backward ends, because
        # what the recomputation saved for backward may be views of them (torch's checkpoint
        # keeps those itself, out of reach of our saved-tensor hooks)
        self.parked: set[ParamGroup] = set()
        self.on_park: Any = None  # called when a group is parked (the hooks queue the end of backward)
        self.on_change: Any = None  # called with a group whose bytes the optimizer or a load replaces
        self.on_written: Any = None  # called with a group written in place while it was materialized
        self.demand_fetches = 0  # groups fetched for a use outside their module (offload.params._demand)

    # -- passes ------------------------------------------------------------------------------
    def begin_pass(self, key: str) -> None:
        """A new pass (the root module's forward) of kind ``key`` starts."""
        self.store.check_files()
        if self.current is not None and self.current.key == key and not self.current.actual:
            return  # end_pass() already opened it and prefetched its start
        self._finish_pass()
        self.current = _Pass(key)

    def end_pass(self) -> None:
        """The pass is over (end of an inference forward, or of backward): keep its order and
        start fetching the first groups of the next pass of the same kind."""
        done = self.current
        if done is None or not done.actual:
            return
        self._finish_pass()
        self.current = _Pass(done.key)
        self._prefetch()

    def _finish_pass(self) -> None:
        done = self.current
        if done is None:
            return
        trace = self.traces.get(done.key)
        if trace != done.actual and done.actual:
            if trace is not None and done.key not in self._warned and not done.diverged:
                self._warned.add(done.key)
                log.info("the %s pass used %d groups where the recorded order had %d; "
                         "re-recorded", done.key, len(done.actual), len(trace))
            self.traces[done.key] = done.actual
            if not self.cached and not self.zero_copy:
                self._choose_cached(done.actual)

    def _choose_cached(self, trace: list[ParamGroup]) -> None:
        """Pick the groups to keep resident across passes: most uses per pass first (a tied
        embedding is used twice), then the largest, within the cache budget. Whatever is
        left streams; room stays for what a pass holds at once besides the cached groups
        and, with ``cache_bytes="auto"``, the prefetch window."""
        uses: dict[ParamGroup, int] = {}
        for group in trace:
            uses[group] = uses.get(group, 0) + 1
        candidates = sorted(uses, key=lambda g: (-uses[g], -g.nbytes))
        device = self.store.tiers[Tier.DEVICE]
        chosen: list[ParamGroup] = []
        total = 0
        for group in candidates:
            size = device.slot_size(group.nbytes)
            reserve = self.layout.need_with_cached(chosen + [group]) if self.layout is not None else 0
            if self.cache_bytes == "auto":
                fits = total + size + self.prefetch_limit + reserve <= self.device_budget
            else:
                fits = total + size <= self.cache_bytes and total + size + reserve <= self.device_budget
            if fits:
                chosen.append(group)
                total += size
        self.cached = {g: False for g in chosen}
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
        if group.resident:
            return
        with DEFER:  # Ctrl-C lands before or after this bookkeeping (or in a wait), not inside
            self._acquire(group, phase, record)

    def _acquire(self, group: ParamGroup, phase: str, record: bool = True) -> None:
        self.parked.discard(group)  # held again: its buffer (parked or not) serves this use
        if record:
            self._record(group, phase)
        else:
            self._log("acquire", group, phase)
        live = self.live[group]
        live.refs += 1
        if phase == "backward":
            live.backward_refs += 1
        if live.flat is None:
            if phase == "demand":
                self.demand_fetches += 1
            try:
                self._materialize(group)
            except BaseException as err:  # not acquired: nothing will release it
                live.refs -= 1
                if phase == "backward":
                    live.backward_refs -= 1
                if isinstance(err, BudgetError):
                    raise self._no_room(group, err) from None
                raise
        self._prefetch()
        if self.partition is not None:
            self._gather_ahead()
        self._log("ready", group, phase)  # compute of the module may start now
        if self.tracer is not None:
            live.started.append((phase, self.tracer.now()))

    def _no_room(self, group: ParamGroup, err: BudgetError) -> BudgetError:
        """The store has no room for ``group`` while this point of the pass holds what it
        holds: say what, and the budget that holds it and the group."""
        if self.partition is not None:
            return err
        device = self.store.tiers[Tier.DEVICE]
        held = [g for g, live in self.live.items() if live.flat is not None or g in self.parked]
        need = device.used_bytes + device.slot_size(group.nbytes)
        parked = (f"; {len(self.parked)} of them ({format_size(sum(g.nbytes for g in self.parked))}) are kept "
                  "from their recomputation (activation checkpointing) until backward has gone through "
                  "them: the device must hold a whole checkpointed block's parameters") if self.parked else ""
        return BudgetError(
            f"device_budget {format_size(self.device_budget)} has no room for parameter group {group.key!r} "
            f"({format_size(group.nbytes)}): {format_size(device.used_bytes)} are held at this point of the pass "
            f"by {len(held)} groups in use ({', '.join(repr(g.key) for g in held[:4])}"
            f"{', ...' if len(held) > 4 else ''}) and the resident parameters{parked}. Set device_budget >= "
            f"{format_size(need)} ({err})")

    def release(self, group: ParamGroup, phase: str) -> None:
        if group.resident:
            return
        with DEFER:
            self._release(group, phase)

    def _release(self, group: ParamGroup, phase: str) -> None:
        live = self.live[group]
        if live.refs == 0 or (phase == "backward" and live.backward_refs == 0):
            return
        live.refs -= 1
        if phase == "backward":
            live.backward_refs -= 1
        self._log("release", group, phase)
        if self.tracer is not None and live.started:
            began_phase, began = live.started.pop()
            self.tracer.span(f"{began_phase} {group.key}", "compute", began, self.tracer.now(), "compute")
        if live.refs == 0:
            if phase != "backward" and in_backward() and live.flat is not None:
                self.parked.add(group)
                if self.on_park is not None:
                    self.on_park()
                return
            self._dematerialize(group)

    def release_backward(self) -> None:
        """End of backward: release every group still held for it (and those parked)."""
        for group, live in self.live.items():
            while live.backward_refs:
                self.release(group, "backward")
        self.unpark()

    def unpark(self) -> None:
        """Release the groups parked during a backward that has ended."""
        parked, self.parked = self.parked, set()
        for group in parked:
            if self.live[group].refs == 0:
                with DEFER:
                    self._dematerialize(group)

    def abandon_forward(self) -> None:
        """A forward was interrupted before its modules released their groups: release
        every acquisition that is not held for a backward, and forget its partial order."""
        for group, live in self.live.items():
            while live.refs > live.backward_refs:
                self.release(group, "forward")
        self.abandon_pass()

    def abandon_pass(self) -> None:
        """Drop the current pass without recording its (partial) order."""
        self.current = None

    def release_all(self) -> None:
        self.unpark()
        for group in self.live:
            self._drop_pending(group)
        for group, live in self.live.items():
            if live.refs:
                live.refs = live.backward_refs = 0
                self._dematerialize(group)
        for group in list(self.ahead):
            self._drop_ahead(group)
        for group, loaded in list(self.cached.items()):
            if loaded:
                self._evict(group)
        self.cached = {}

    def in_use(self, group: ParamGroup) -> bool:
        """Whether a pass computes (or may still compute, parked) with ``group``'s bytes."""
        return bool(self.live[group].refs) or group in self.parked

    def forget(self, group: ParamGroup) -> None:
        """The optimizer is about to replace ``group``'s bytes in its home tier: drop what
        the coordinator holds of the old ones (a prefetch, a resident-cache copy)."""
        if group in self.parked and not in_backward():  # left by a backward that never ended
            self.unpark()
        if self.in_use(group):
            raise RuntimeError(f"parameter group {group.key!r} is in use by a forward or backward "
                               "pass: call the optimizer's step() after backward() returns")
        self._drop_pending(group)
        self.ahead.pop(group, None)
        if self.cached.get(group):
            self.cached[group] = False
        self.live[group].written += 1
        if self.on_change is not None:
            self.on_change(group)

    def note_written(self, group: ParamGroup) -> None:
        """The caller changed ``group``'s materialized bytes in place and marked them (copies
        taken before are stale; its release need not find the change again)."""
        live = self.live[group]
        live.written += 1
        if live.flat is not None:
            live.versions = _versions(group)

    def written_version(self, group: ParamGroup) -> int:
        return self.live[group].written
    def resume_prefetch(self) -> None:
        """Fetch ahead again from the current position (after the optimizer's step)."""
        self._prefetch()

    # -- internals -----------------------------------------------------------------------------
    def _record(self, group: ParamGroup, phase: str) -> None:
        p = self.current
        if p is None:  # a module called outside its root's forward (e.g. model.lm_head(x))
            self.begin_pass("direct")
            p = self.current
        trace = self.traces.get(p.key)
        if trace is not None and not p.diverged:
            expected = trace[p.cursor % len(trace)] if trace else None
            if expected is group:
                p.cursor += 1
            else:
                p.diverged = True
                if p.key not in self._warned:
                    self._warned.add(p.key)
                    log.info("execution order of the %s pass changed at step %d (expected %s, got "
                             "%s): fetching on demand for this pass and re-recording", p.key,
                             len(p.actual), expected.key if expected else None, group.key)
                for other in list(self.ahead):
                    self._drop_ahead(other)
                for other, live in self.live.items():
                    if live.pending is not None:
                        self._drop_pending(other)
        p.actual.append(group)
        self._log("acquire", group, phase)

    def _materialize(self, group: ParamGroup) -> None:
        live = self.live[group]
        if self.zero_copy and self._map(group, live):
            return
        if live.pending is not None:  # gathered ahead of use (several ranks)
            self._take_pending(group, live)
            return
        ahead = False
        if self.cached.get(group):
            self.prefetch_hits += 1
        elif group in self.ahead:
            del self.ahead[group]
            self.prefetch_hits += 1
            ahead = True
        else:
            self.prefetch_misses += 1
            if self.store.state(group.key, Tier.DEVICE) is Residency.ABSENT:
                self._make_room(group)
                self._log("fetch", group, "demand")
                self.store.fetch(group.key, Tier.DEVICE, priority=0)
        started = time.perf_counter()
        try:
            flat = self.store.wait(group.key, Tier.DEVICE)
        except OSError as err:
            if not ahead:
                raise
            # a read ahead failed (maybe during an outage that has ended): read it again
            # now; a lasting fault fails this read too, and that error is raised
            log.info("prefetch of %s failed (%s); reading it again on demand", group.key, err)
            self._make_room(group)
            self.store.fetch(group.key, Tier.DEVICE, priority=0)
            flat = self.store.wait(group.key, Tier.DEVICE)
        ended = time.perf_counter()
        self.stall_seconds += ended - started
        if self.tracer is not None and ended - started > 1e-5:
            self.tracer.span(f"stall {group.key}", "stall", started, ended, "compute")
        if self.partition is not None:
            flat = self._gather(group, live, flat)
        self._point(group, live, flat)

    def _point(self, group: ParamGroup, live: _Live, flat: torch.Tensor) -> None:
        """Point the group's parameters at views of its (whole) flat device buffer."""
        live.flat = flat
        if group in self.cached:
            self.cached[group] = True
            self.ahead.pop(group, None)
        for slot in group.slots:
            point(slot.param, flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
        live.versions = _versions(group)
        self.by_storage[flat.untyped_storage().data_ptr()] = group

    def _map(self, group: ParamGroup, live: _Live) -> bool:
        """Point the group's parameters at a view of its bytes in the mapped swap file."""
        got = self.store.map_view(group.key)
        if got is None:  # newest bytes elsewhere (being written, or in another tier): copy
            return False
        if self.ahead.pop(group, False) is None:
            self.prefetch_hits += 1  # its read-ahead was advised
        else:
            self.prefetch_misses += 1
        flat, live.release = got
        live.flat = flat
        for slot in group.slots:
            point(slot.param, flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
        live.versions = _versions(group)
        self.by_storage[flat.untyped_storage().data_ptr()] = group
        return True

    def _dematerialize(self, group: ParamGroup) -> None:
        live = self.live[group]
        if live.flat is not None:
            self._check_written(group, live)
        if live.release is not None:  # a mapped view: give it back, nothing to evict
            release, live.release = live.release, None
            self.by_storage.pop(live.flat.untyped_storage().data_ptr(), None)
            live.flat = None
            for slot in group.slots:
                point(slot.param, self.placeholder(slot.dtype, slot.shape))
            release()
            return
        if live.flat is not None:
            self.by_storage.pop(live.flat.untyped_storage().data_ptr(), None)
            live.flat = None
            for slot in group.slots:
                point(slot.param, self.placeholder(slot.dtype, slot.shape))
            if live.gathered is not None:
                device = self.store.tiers[Tier.DEVICE]
                if hasattr(device, "fence"):
                    device.fence(live.gathered)  # kernels queued on it finish before reuse
                device.free(live.gathered)
            live.gathered = None
        elif group in self.ahead or self.store.state(group.key, Tier.DEVICE) is Residency.ABSENT:
            return
        # (else: an acquisition interrupted between its fetch and its wait left a device
        # copy that nothing points at; it is dropped or kept below like any other)
        if group in self.cached:
            return  # stays resident on the device across passes
        if self._needed_soon(group):
            self.ahead[group] = None  # keep the bytes on the device for the coming use
        else:
            self._evict(group)

    def _check_written(self, group: ParamGroup, live: _Live) -> None:
        """Code inside the group's module changed it in place (a view of a weight, or its
        ``.data``, which has a version counter of its own): keep the change (the device copy
        becomes the newest, written home when dropped) and say so."""
        changed = live.maybe_written or _versions(group) != live.versions
        live.maybe_written = False
        if not changed:
            return
        if live.gathered is not None:  # several ranks: the gathered copy is not what is stored
            if _versions(group) != live.versions:
                raise RuntimeError(
                    f"parameter group {group.key!r} was written in place inside its module's forward with the "
                    "model partitioned over ranks: each rank stores a slice, not the gathered copy that was "
                    "written. Write parameters before offload.wrap, or load them with offload.load_checkpoint")
            return
        live.written += 1
        if live.release is None and self.home is not Tier.DEVICE:  # (a mapped view is the home copy)
            self.store.mark_dirty(group.key, Tier.DEVICE)
        if self.on_written is not None:
            self.on_written(group)

    def _used(self) -> int:
        """Device bytes in use, as decisions see them: the tier's count, or with several ranks
        the coordinator's own (the tier's moves with the timing of reads, which differs from
        rank to rank; decisions that lead to collectives must not)."""
        if self.partition is not None:
            return self._accounted_device_bytes()
        return self.store.tiers[Tier.DEVICE].used_bytes

    def _make_room(self, group: ParamGroup) -> None:
        """A demand fetch comes first: drop the farthest prefetches until it fits."""
        device = self.store.tiers[Tier.DEVICE]
        while self.ahead and self._used() + device.slot_size(group.nbytes) > self.device_budget:
            self._drop_ahead(next(reversed(self.ahead)))

    def _drop_ahead(self, group: ParamGroup) -> None:
        self.ahead.pop(group, None)
        if self.live[group].pending is not None:
            self.live[group].pending[0].wait()  # it reads the slice: done before the slice goes
        if self.live[group].flat is None and not self.zero_copy:
            self._evict(group)

    def _evict(self, group: ParamGroup) -> None:
        if self.home is not Tier.DEVICE:  # slices resting on the device stay there
            self.store.evict(group.key, Tier.DEVICE)

    def _upcoming(self):
        """Groups after the cursor in the recorded order, wrapping into the next pass."""
        p = self.current
        trace = self.traces.get(p.key) if p is not None and not p.diverged else None
        if not trace:
            return
        for i in range(len(trace)):
            yield trace[(p.cursor + i) % len(trace)]

    def _window(self) -> list[ParamGroup]:
        """The nearest upcoming groups not materialized now, up to ``prefetch_limit`` bytes."""
        window: list[ParamGroup] = []
        total = 0
        for group in self._upcoming():
            if group in window or self.live[group].flat is not None or self.cached.get(group):
                continue
            if total + group.nbytes > self.prefetch_limit:
                break
            window.append(group)
            total += group.nbytes
        return window

    def _needed_soon(self, group: ParamGroup) -> bool:
        return group in self._window()

    def _prefetch(self) -> None:
        # Groups fetched ahead stay until used even when the window moves past them (they
        # are in trace order, so they are needed soon); dropping and refetching them would
        # read the same bytes twice.
        if self.zero_copy:  # read-ahead advice for the window; no device copies
            for group in self._window():
                if group not in self.ahead:
                    self._log("fetch", group, "prefetch")
                    self.store.advise(group.key)
                    self.ahead[group] = None
            return
        device = self.store.tiers[Tier.DEVICE]
        ahead_bytes = sum(g.nbytes for g in self.ahead)
        counted = self._used() if self.partition is not None else None  # (counted once, then kept up)
        for group in self._window():
            if group in self.ahead:
                continue
            if ahead_bytes + group.nbytes > self.prefetch_limit:
                break
            # prefetches never wait for room: they only use what is free now (a demand
            # fetch that finds no room drops the farthest of them, see _make_room)
            used = device.used_bytes if counted is None else counted
            if used + device.slot_size(group.nbytes) > self.device_budget:
                break
            self._log("fetch", group, "prefetch")
            self.store.fetch(group.key, Tier.DEVICE, priority=1)
            self.ahead[group] = None
            ahead_bytes += group.nbytes
            if counted is not None:
                counted += device.slot_size(self.partition.slice_bytes(group.nbytes))

    def placeholder(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        key = (dtype,)
        base = self._placeholders.get(key)
        if base is None:
            fill = float("nan") if (dtype.is_floating_point or dtype.is_complex) else 0
            base = torch.full((1,), fill, dtype=dtype, device=self.device)
            self._placeholders[key] = base
        return base.expand(shape) if len(shape) else base.view(())

    def _log(self, event: str, group: ParamGroup, phase: str) -> None:
        if self.events is not None:
            self.events.append((event, group.key, phase))


def _versions(group: ParamGroup) -> tuple:
    """The version counters of the group's parameters (an in-place op bumps its tensor's)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tuple(slot.param._version for slot in group.slots)


def refuse_copy() -> None:
    """copy.deepcopy / pickling of a wrapped model reaches the objects behind its hooks."""
    raise TypeError("copy.deepcopy or pickling of a model wrapped by offload: its parameters rest in offload's tiers "
                    "and its hooks hold files and threads. For a copy in memory, build the model again and "
                    "load_state_dict(offload.state_dict(model)), or offload.unwrap(model) first; to save it, "
                    "offload.save_checkpoint(path, model) or offload.export(model, directory)")
