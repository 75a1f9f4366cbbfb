"""The update in the next forward: ``step()`` decides the step at once (the clip factor and an
fp16 overflow come from the norms noted when the gradients were written) and leaves the
update of a wrapped model's shards to the next forward, where each parameter group is
brought up to date just before it is used.

One :class:`NextForward` lives from that ``step()`` until its last shard is written. It
registers with each wrapped model it updates (``params._pending``): the coordinator asks it
before materializing a group and never reads ahead a group it still owes, a torch call on a
managed parameter asks for the parameter's group, and checkpoints, export and ``unwrap``
settle it. Shards are updated in their order (the model's group order, which is the order a
forward usually uses them in), with the reads of the next ones issued ahead: a group's use
waits for its own shards only; between uses, shards whose reads have landed are updated
without waiting. Every other call of the optimizer (``step``, ``clip_grad_norm_``,
``state_dict``, ``synchronize``, a gradient of the next backward ...) settles it first, so the
result is exactly ``backward(); clip; step()`` run at once.

The step's settings are kept as ``step()`` saw them (an LR scheduler stepping right after
changes the next step, not this one). Gradients are needed until the update has read them,
so ``zero_grad()`` / ``p.grad = None`` meanwhile hide them (``p.grad`` reads None) and drop
them once the update is done.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .._signals import DEFER
from ..store import Tier
from ._layout import Shard
from ._phase import OptimizerPhase, Phase
from ._settings import copy_settings
from ._pipeline import READ_AHEAD, Pipeline
from ._writeback import WriteBack

__all__ = ["NextForward", "Deferral"]


class NextForward:
    """One step's update of a wrapped model's shards, owed to the next forward (module
    docstring); a ``params._pending.Writer`` of each model it updates."""

    def __init__(self, work: list[Shard], pipeline: Pipeline, writeback: WriteBack, phase: Phase, *,
                 groups: list[dict], grad_scale: Callable[[], float], stats: dict,
                 done: Callable[["NextForward"], None]):
        # grad_scale(): the loss scale now (a held sum's factors follow its changes, so the
        # ratio the update divides by is the one of the step)
        self.work, self.pipeline, self.writeback, self.phase = work, pipeline, writeback, phase
        self.groups, self.grad_scale, self.stats, self._done = groups, grad_scale, stats, done
        self.pending = writeback.plan(work)
        self.position = 0  # work[:position] is updated
        self.began = False  # an update has begun (an error from then on leaves a mix)
        self.issued: set[int] = set()
        self.busy: list = []  # group writes waiting for a pass to release the group
        self.last: dict[int, int] = {}  # id(whole group) -> index of the last shard covering it
        managers = {}
        for i, shard in enumerate(work):
            for seg in shard.segments:
                group = seg.owner.group
                self.last[id(group.whole or group)] = i
                managers[id(seg.owner.manager)] = seg.owner.manager
        self.managers = list(managers.values())
        self.hidden: dict[int, torch.Tensor] = {}  # p.grad = None while owed: dropped when done
        self.hide_all = False  # zero_grad() while owed
        self.seconds = 0.0
        self._running = False  # (our own reads and writes of the groups ask nothing)
        self.closed = False

    # -- params._pending.Writer -------------------------------------------------------------
    def stale(self, group) -> bool:
        i = self.last.get(id(group))
        return i is not None and not self._running and self.position <= i

    def before_use(self, group) -> None:
        self._advance(self.last[id(group)])

    def settle(self) -> None:
        self._advance(len(self.work) - 1, settling=True)

    def _room_to_hold(self, store) -> bool:
        """Whether a group's new host copy (already in ``store``'s pool) may stay there
        (``store.hold_back``: the backward and the next update read it from memory instead
        of the disk): only while the pool keeps room beside it for the shards read next and
        for compute's transfers, which the held copies must never wait on."""
        ahead = sum(s.bytes_in_flight for s in self.work[self.position + 1: self.position + 2 + READ_AHEAD]
                    if s.store is store)
        pool = store.staging
        return pool.budget - pool.in_use_bytes >= ahead + self.pipeline.reserve(store)

    # -- the work ---------------------------------------------------------------------------
    def start(self) -> None:
        """At ``step()``: read the first shards, so the forward's first groups find them. A
        read refused now (an I/O error) is made again at the use that needs it. From now on
        the groups it writes may be held in host memory (``_room_to_hold``)."""
        self.writeback.hold = self._room_to_hold
        try:
            for shard in self.work[: 1 + READ_AHEAD]:
                if self.pipeline.writes_backlogged() or not self.pipeline.room_beside_compute(shard, self.pending):
                    break
                self.pipeline.issue(shard, self.issued, self.pending)
        except Exception:  # noqa: BLE001 - (an interrupt goes through: nothing was updated)
            self._read_again()

    def _advance(self, until: int, *, settling: bool = False) -> None:
        """Update the shards up to ``work[until]``, waiting for their reads; then those after
        it whose reads have landed; issue the reads ahead."""
        if self._running or self.closed:  # (settle() from inside our own work: it goes on)
            return
        self._running = True
        began = time.perf_counter()
        work = self.work
        updating = False  # an error inside an update (or a write) leaves a mix: poisoned
        try:
            while self.position < len(work):
                block = self.position <= until
                for nxt in work[self.position: self.position + 1 + READ_AHEAD]:
                    if id(nxt) not in self.issued:
                        if block and nxt is work[self.position]:
                            self.pipeline.bound_writes()
                        elif self.pipeline.writes_backlogged() or \
                                not self.pipeline.room_beside_compute(nxt, self.pending):
                            break  # (read later, once a write has landed or at its use)
                    self.pipeline.issue(nxt, self.issued, self.pending)
                head = work[self.position]
                # ahead of its use, a shard is updated once its reads have landed (that frees
                # room to read the next: the disk stays busy); one with nothing to read waits
                # for its use, so the forward's compute is not held up by updates it will not
                # need yet
                if not block and (head.home is Tier.HOST or id(head) not in self.issued
                                  or not self.pipeline.in_memory(head, self.pending)):
                    break
                self._reads_landed(head)
                updating = self.began = True
                self.pipeline.process(head, self.grad_scale(), self.pending, busy=self.busy,
                                      where="next forward", groups=self.groups)
                self.position += 1
                updating = False
            updating = True
            # (step() defers only when no pass holds a group; one held since is refused when
            # settling: everything is owed now)
            busy, self.busy = self.busy, []
            self.busy = self.writeback.finish_released(busy, force=settling)
            done = self.position == len(work) and not self.busy
        except BaseException:
            self._running = False
            if updating:
                self.abandon()
            else:  # only waiting for reads (one failed, an interrupt): nothing was changed
                self._read_again()
            raise
        finally:
            self._running = False
            spent = time.perf_counter() - began
            self.seconds += spent
            for manager in self.managers:  # (the step log's optimizer time)
                manager.optimizer_time(spent)
        if done:
            self._finish()

    def _reads_landed(self, shard: Shard) -> None:
        """Wait for what updating ``shard`` reads. A read made ahead that failed is made
        again once, now (an outage may have ended); a lasting fault fails that read too."""
        try:
            self._wait_reads(shard)
        except Exception:  # noqa: BLE001 - (an interrupt is not retried)
            self._read_again()
            self.pipeline.issue(shard, self.issued, self.pending)
            self._wait_reads(shard)

    def _wait_reads(self, shard: Shard) -> None:
        for key in shard.host_reads:
            shard.store.wait(key, Tier.HOST)
        self.writeback.wait_copies(shard, self.pending)

    def _read_again(self) -> None:
        """A wait for reads failed (an I/O error, an interrupt): only the use that asked
        fails. The reads issued (any of them may have failed too) are dropped and made again
        when the next use asks."""
        rest = self.work[self.position:]
        self.pipeline.abandon(rest, self.issued)
        for shard in rest:
            self.writeback.unfetch(shard, self.pending)

    def _finish(self) -> None:
        with DEFER:  # (closed, and handed back, together)
            self.closed = True
            self.writeback.hold = None
            try:
                self.stats["forward_update_seconds"] += self.seconds
                self.phase.enter(OptimizerPhase.IDLE)
            finally:
                self._done(self)

    def abandon(self) -> None:
        """The update failed (or the optimizer or model is closing before it ran): nothing
        more of it is applied. Poisoned where some shard's update had begun; the host copies
        read ahead are dropped."""
        if self.closed:
            return
        self.closed = True
        self.writeback.hold = None
        try:
            if self.began:
                self.phase.poison(f"step() stopped after updating {self.position} of {len(self.work)} shards "
                                  "(its update, which runs in the next forward)")
            self.pipeline.abandon(self.work[self.position:], self.issued)
            self.writeback.drop_copies(list(self.pending.values()) + self.busy)
        finally:
            self.pending, self.busy = {}, []
            if not self.phase.poisoned:
                self.phase.enter(OptimizerPhase.IDLE)
            self._done(self)


class Deferral:
    """The optimizer's side: whether a step may leave its update to the next forward, the
    update owed now, and the gradients dropped while it is owed."""

    def __init__(self, pipeline: Pipeline, writeback: WriteBack, phase: Phase, stats: dict, *, enabled: bool,
                 partitioned: Callable[[], bool], sink_open: Callable[[], bool], grads: Callable[[], object],
                 drop: Callable[[], None]):
        # partitioned(): several ranks, where the update stays inside step() (an all-gather
        # ahead is decided alike on every rank, which updates landing at their own pace in
        # each rank's forward would break)
        # grads(): the GradientBook; drop(): drop every gradient held (a zero_grad() made
        # while owed, once done)
        self.pipeline, self.writeback, self.phase, self.stats = pipeline, writeback, phase, stats
        self.enabled = bool(enabled)
        self._partitioned, self._sink_open = partitioned, sink_open
        self._grads, self._drop = grads, drop
        self.owed: NextForward | None = None

    def deferrable(self, work: list[Shard]) -> bool:
        """Whether the update of ``work`` may wait for the next forward: all of it is a
        wrapped model's (plain parameters have nobody to ask before they are read, and a step
        half done now and half owed could not be told apart from a whole one after an
        interrupt), no backward is still adding (a step from one of its hooks), no pass holds
        one of its groups, and the model is not partitioned over several ranks."""
        if not work or not self.enabled or self._sink_open() or self._partitioned():
            return False
        for shard in work:
            if not shard.wrapped:
                return False
            for seg in shard.segments:
                manager, group = seg.owner.manager, seg.owner.group
                if manager.coordinator.in_use(group.whole or group):
                    return False
        return True

    def prepare(self, later: list[Shard], param_groups: list[dict], grad_scale: Callable[[], float]) -> NextForward:
        """The update of ``later``, planned (nothing updated, nothing registered yet)."""
        return NextForward(later, self.pipeline, self.writeback, self.phase, groups=copy_settings(param_groups),
                           grad_scale=grad_scale,
                           stats=self.stats, done=self._done)

    def owe(self, nf: NextForward) -> None:
        """From now on the models ask ``nf`` before reading its groups; its first reads start."""
        with DEFER:  # (all of it or, before it, nothing: a forward must never miss an owed group)
            for manager in nf.managers:
                manager.pending.add(nf)
            self.owed = nf
            self.phase.enter(OptimizerPhase.UPDATING_IN_FORWARD)
        nf.start()

    def settle(self) -> None:
        """Finish the update owed, if any."""
        if self.owed is not None:
            self.owed.settle()

    def abandon(self) -> None:
        """Closing: the update owed is dropped (poisoned where it had begun)."""
        if self.owed is not None:
            self.owed.abandon()

    def hidden(self, param: torch.Tensor) -> bool:
        nf = self.owed
        return nf is not None and (nf.hide_all or id(param) in nf.hidden)

    def hide(self, param: torch.Tensor | None = None) -> bool:
        """``p.grad = None`` (``param``) or ``zero_grad()`` (None) while an update is owed:
        hidden now, dropped when it is done. False when nothing is owed (drop it now)."""
        nf = self.owed
        if nf is None:
            return False
        if param is None:
            nf.hide_all = True
        else:
            nf.hidden[id(param)] = param
        self._grads().hide(param)
        return True

    def _done(self, nf: NextForward) -> None:
        """``nf`` is written (or abandoned): the models stop asking it; the gradients dropped
        meanwhile go now."""
        with DEFER:  # (the gradients hidden meanwhile are dropped with it, not revived by an interrupt)
            try:
                for manager in nf.managers:
                    manager.pending.remove(nf)
            finally:
                self.owed = None
                if nf.hide_all:
                    self._drop()
                else:
                    for p in nf.hidden.values():
                        self._grads().assign(p, None)
