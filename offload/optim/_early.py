"""``update_during_backward()``: a backward updates each shard as soon as its gradient is
final (every parameter of it reported), overlapping the optimizer's reads, update and
write-backs with the rest of the backward; ``step()`` then finishes what is left.

One :class:`EarlyUpdate` lives from entering the block to the ``step()`` that finishes it.
It listens to the gradient sink: a final shard is queued and its reads issued (two ahead);
the queue is advanced from the gradient hooks without waiting (a shard whose states are not
in memory yet waits for a later hook), and a group still held by the backward is written
when released. The result is exactly ``backward(); step()``: the rules that make it so
(no clipping, no loss scaling, each parameter reports once) are checked by the optimizer
and here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ..io import PAGE_SIZE, round_up
from ..store import Residency, Tier
from ._layout import ParamEntry, Shard
from ._phase import Phase
from ._pipeline import READ_AHEAD, Pipeline
from ._settings import copy_settings, same_setting
from ._sink import on_drain_thread
from ._writeback import WriteBack

__all__ = ["EarlyUpdate", "SettingsChangedError", "refuse_to_start"]


class SettingsChangedError(RuntimeError):
    """A parameter group's settings changed between ``update_during_backward()`` and the
    ``step()`` that finished it; the step was taken whole with the earlier settings."""


def refuse_to_start(*, loss_scaling: bool, clipped: bool, shards: list[Shard]) -> None:
    """Entering ``update_during_backward()``: refuse what would make its result differ."""
    if loss_scaling:
        raise ValueError("update_during_backward() cannot be used with fp16 loss scaling: an overflow "
                         "must skip the whole step, so every gradient has to be seen first. Use bf16 or "
                         "fp32, or call step() after backward() (its update runs in the next forward)")
    if clipped or any(seg.scale != 1.0 for s in shards for seg in s.segments):
        raise ValueError("clip_grad_norm_() was called before update_during_backward(): the clip "
                         "factor must come from this step's gradients; clip without "
                         "update_during_backward() (backward(), clip_grad_norm_(), step(): its update "
                         "runs in the next forward)")


class EarlyUpdate:
    def __init__(self, shards: list[Shard], pipeline: Pipeline, writeback: WriteBack, phase: Phase,
                 groups: list[dict]):
        self.pipeline, self.writeback, self.phase = pipeline, writeback, phase
        # the groups' settings as the first shard was updated in the backward: the step()
        # that finishes it takes them too (a change in between is refused)
        self.groups: list[dict] = groups
        self.settings: list[dict[str, Any]] | None = None
        self.changed: list[str] = []
        self.queue: list[Shard] = []  # final, not updated yet (reads issued ahead)
        self.done: set[int] = set()  # ids of the shards updated during this backward
        self.issued: set[int] = set()
        self.busy: list = []  # group writes waiting for a pass to release the group
        # every wrapped shard counts toward its groups (those that get no gradient in the
        # pass are merged from the current bytes at step())
        self.pending = writeback.plan([s for s in shards if s.wrapped])
        # what the rest of the backward takes of each store's pool for its gradient sums
        # (``_backward_room``), counted once here and lessened as shards become final
        self._sums: dict[int, tuple[int, int]] = {}  # id(shard) -> (id(store), host bytes it will take)
        self._host_left: dict[int, int] = {}
        self._largest: dict[int, int] = {}
        for s in shards:
            if not s.wrapped:
                continue
            key = id(s.store)
            if s.grad_home is Tier.HOST:
                host = s.store.tiers[Tier.HOST].slot_size(s.numel * 4) \
                    if s.store.state(s.grad_key, Tier.HOST) is not Residency.RESIDENT else 0
                self._sums[id(s)] = (key, host)
                self._host_left[key] = self._host_left.get(key, 0) + host
            else:  # (the largest accumulator, for the whole backward: a bound, not tracked down)
                self._largest[key] = max(self._largest.get(key, 0), round_up(s.numel * 4, PAGE_SIZE))

    # -- the sink's listener --------------------------------------------------------------
    def gradient(self, entry: ParamEntry) -> None:
        for seg in entry.segments:
            if id(seg.shard) in self.done or seg.shard in self.queue:
                self._poison_if_updated()
                raise RuntimeError(
                    f"a parameter of shape {tuple(entry.param.shape)} received a gradient after its shard was "
                    "final in an update_during_backward() step (a second backward before step(), or a "
                    "reentrant backward that reports a parameter twice). "
                    + ("Shards updated already hold this step's weights: load a checkpoint or state "
                       "dicts to go on. " if self.done else "")
                    + "Run that backward outside update_during_backward()")

    def shard_final(self, shard: Shard) -> None:
        key, host = self._sums.pop(id(shard), (None, 0))
        if key is not None:
            self._host_left[key] -= host
        self.queue.append(shard)
        if not on_drain_thread():
            self.advance(block=False)
        # else (CUDA: gradients are added on the drain worker): the next gradient hook, on
        # the backward's own thread where the coordinator runs, advances the queue

    def device_gradient(self) -> None:
        if self.queue:
            self.advance(block=False)

    def give_way(self) -> None:
        """The backward needs host room: update the queued shards now (their gradients are
        final), so that their rows and groups go home and free it as the writes land. Groups
        the pass still uses stay owed (written when released). Not on a drain worker (CUDA):
        the queue is the backward's thread's, as in ``shard_final``."""
        if self.queue and not on_drain_thread():
            self.advance(block=True, release_all=False)

    # -- the work ---------------------------------------------------------------------------
    def advance(self, *, block: bool, release_all: bool | None = None) -> None:
        """Update the queued shards whose reads have landed (all of them when ``block``),
        then write the groups the pass released (all, when ``release_all``: the default
        is ``block``, as at ``step()``, where no pass holds any)."""
        queue = self.queue
        while queue:
            for shard in queue[: 1 + READ_AHEAD]:
                if id(shard) not in self.issued:  # reading another shard: within the shards in flight
                    if block:
                        self.pipeline.bound_writes()
                    elif self.pipeline.writes_backlogged() or not self.pipeline.room_beside_compute(
                            shard, self.pending, backward=self._backward_room(shard.store)):
                        break  # (the backward goes on; a later call reads it, or step() does)
                self.pipeline.issue(shard, self.issued, self.pending)
            head = queue[0]
            # (a head whose rows were read during the backward is in memory, but not issued
            # when the writes were backlogged: its read is asked for, and counted, first)
            if not block and (id(head) not in self.issued or not self._in_memory(head)):
                break
            queue.pop(0)
            if self.settings is None:  # (the settings this step's updates take: see finish)
                self.settings = copy_settings(self.groups)
            try:
                self.pipeline.process(head, 1.0, self.pending, busy=self.busy, where="backward")
            except BaseException:
                self.queue.insert(0, head)
                self.abandon()
                raise
            self.done.add(id(head))
        busy, self.busy = self.busy, []
        self.busy = self.writeback.finish_released(busy, force=block if release_all is None else release_all)

    def _backward_room(self, store: Any) -> int:
        """Host pool bytes of ``store`` the rest of the backward takes for its gradients: the
        sums that rest there and were not in host memory as it began, and the largest
        accumulator of those that rest on NVMe. A read ahead leaves it free: else the backward
        would wait for room that only a later gradient hook, the one waiting, could free."""
        return self._host_left.get(id(store), 0) + self._largest.get(id(store), 0)

    def _in_memory(self, shard: Shard) -> bool:
        return self.pipeline.in_memory(shard, self.pending)

    def finish(self, rest_of: Callable[[set[int]], list[Shard]]) -> list[Shard]:
        """``step()``: update the shards still queued, then ``rest_of(done ids)`` (shards with
        gradients that did not become final in the pass), then write every parameter group.
        Returns the shards updated in this step. Settings changed since the backward updated
        its first shard are noted (``changed``) and this step takes the earlier ones, as the
        backward's shards did (none updated: the current ones, as torch's step())."""
        try:
            with self._earlier_settings():
                self.advance(block=True)
                rest = rest_of(self.done)
                self.pipeline.run(rest, 1.0, self.pending)
                self.writeback.finish_rest(self.pending)
        except BaseException:
            self.abandon()  # (shards updated during backward hold this step's states)
            raise
        return rest

    @contextlib.contextmanager
    def _earlier_settings(self) -> Iterator[None]:
        settings = self.settings or []
        self.changed = [f"group {i}'s {k} changed from {saved[k]!r} to {g.get(k)!r}" for i, (g, saved)
                        in enumerate(zip(self.groups, settings)) for k in saved if k != "params" and not same_setting(saved[k], g.get(k))]
        if not self.changed:
            yield
            return
        now = [dict(g) for g in self.groups]
        for g, saved in zip(self.groups, settings):
            g.update(saved)
        try:
            yield
        finally:
            for g, values in zip(self.groups, now):  # (the same dicts: a scheduler holds them)
                g.clear()
                g.update(values)

    def refuse_changed_settings(self) -> None:
        """After the step's bookkeeping: say that it took the earlier settings, and why."""
        if self.changed:
            raise SettingsChangedError(
                f"{'; '.join(self.changed[:3])} after the backward in update_during_backward() began updating "
                "shards, as their gradients were final, with the settings of that moment; so this step took the "
                "earlier ones throughout (torch's step() would take the new ones). Set the learning rate and the "
                "other settings before the backward (a scheduler's step() right after optimizer.step()), or "
                "drop update_during_backward() (the default update, in the next forward, takes the settings "
                "step() sees)")

    def abandon(self) -> None:
        """The backward (or an update in it, or the step finishing it) failed: nothing of it
        may be applied later. Poisons first, so an interrupt of the clean-up cannot lose it;
        a second call has nothing left to drop."""
        self._poison_if_updated()
        queue, self.queue = self.queue, []
        entries, self.pending, self.busy = list(self.pending.values()) + self.busy, {}, []
        self.pipeline.abandon(queue, self.issued)
        self.writeback.drop_copies(entries)

    def _poison_if_updated(self) -> None:
        if self.done:
            self.phase.poison(f"update_during_backward() stopped after updating {len(self.done)} shards "
                              "during backward")
