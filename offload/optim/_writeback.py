"""Writing a step's new weights back to the wrapped model's parameter tier, a parameter
group at a time, once every shard covering the group is updated.

A group of fp32 parameters resting on NVMe or in host memory is its own master: its host
copy (the home copy, or one read from NVMe) is updated in place and written home from it.
Other groups are assembled from their shards' master rows, cast to the parameters' dtype,
and written with ``ParamManager.write_group``; parameters of the group this step does not
update keep their current bytes. Either way the coordinator forgets its old device copies.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..accel import host_compute
from ..store import Residency, Tier
from ._layout import MasterMode, Owner, Shard
from ._moved import count
from ._sizing import wrapped_mode

__all__ = ["GroupWrite", "WriteBack", "settled"]

_KEPT = (Residency.RESIDENT, Residency.STORING)  # a host copy a fetch finds in memory


@dataclass(eq=False)
class GroupWrite:
    """A wrapped parameter group's new bytes, assembled from the shards that cover it."""
    manager: Any
    group: Any
    remaining: int = 0  # shards of this step still to update it
    data: torch.Tensor | None = None
    written: list = field(default_factory=list)  # (byte offset, bytes) assembled so far
    in_place: bool = False  # updated in a host copy of the group (fp32, no master row)
    fetched: bool = False  # that host copy was asked for
    owed: bool = False  # that copy was held back with its write still owed (counted then)

    @property
    def in_use(self) -> bool:
        """Whether a forward or backward pass still computes with the group's old bytes."""
        return self.manager.coordinator.in_use(self.group.whole or self.group)


def _taken(entry: GroupWrite) -> torch.Tensor:
    """The group's host copy, for an update to write in place; one held back is no longer
    (``unhold``: nothing writes it home or sheds it while it is being updated; ``finish``
    holds it again or writes it)."""
    store, key = entry.manager.store, entry.group.key
    data = store.wait(key, Tier.HOST)
    entry.owed = store.unhold(key)
    return data


class WriteBack:
    def __init__(self, stats: dict):
        self.stats = stats
        # while an update runs in the next forward: whether a group's new host copy may stay
        # in host memory (``store.hold_back``), given its store
        self.hold: Callable[[Any], bool] | None = None

    def plan(self, work: list[Shard], pending: dict | None = None) -> dict[int, GroupWrite]:
        """For each wrapped parameter group touched by ``work`` and not in ``pending``: how
        many of the shards cover it, and its current bytes where some of its parameters are
        not updated by them. Returns ``pending`` with those added (id(group) -> record)."""
        pending = {} if pending is None else pending
        new: dict[int, GroupWrite] = {}
        covered: dict[int, int] = defaultdict(int)
        for shard in work:
            if not shard.wrapped:
                continue
            for owner in {id(s.owner.group): s.owner for s in shard.segments}.values():
                if id(owner.group) in pending:
                    continue
                entry = _new(owner)
                if entry is not None:
                    new.setdefault(id(owner.group), entry).remaining += 1
            for seg in shard.segments:
                covered[id(seg.owner.group)] += seg.length * seg.owner.slot.dtype.itemsize
        for key, entry in new.items():
            # (the parameters' bytes, not the group's: padding between them needs no keeping)
            if not entry.in_place and covered[key] < sum(hi - lo for lo, hi in (s.held for s in entry.group.slots)):
                entry.data = entry.manager.group_bytes(entry.group)  # keep what this step does not update
        pending.update(new)
        return pending

    def fetch(self, shard: Shard, pending: dict) -> None:
        """Ask for the host copies of the groups ``shard`` updates in place."""
        if not shard.wrapped or shard.master:
            return
        for seg in shard.segments:
            entry = pending.get(id(seg.owner.group))
            if entry is not None and entry.in_place and not entry.fetched:
                entry.fetched = True
                store = entry.manager.store
                # (else the host copy is its home, one held back since the last update, or one
                # still being written home, which the fetch keeps: nothing is read)
                if entry.manager.home is not Tier.HOST and store.state(entry.group.key, Tier.HOST) not in _KEPT:
                    store.fetch(entry.group.key, Tier.HOST)
                    self.stats["read_bytes"] += entry.group.nbytes
                    count(self.stats, "parameters", read=entry.group.nbytes)

    def copy_bytes(self, shard: Shard, pending: dict) -> int:
        """Host pool bytes ``fetch(shard)`` would read into: the group copies not in memory yet."""
        total = 0
        for entry in self._in_place(shard, pending):
            store = entry.manager.store
            if not entry.fetched and entry.manager.home is not Tier.HOST \
                    and store.state(entry.group.key, Tier.HOST) not in _KEPT:
                total += store.tiers[Tier.HOST].slot_size(entry.group.nbytes)
        return total

    def views(self, shard: Shard, pending: dict) -> dict | None:
        """For a wrapped shard without master rows: the fp32 tensor each segment is updated
        in (a slice of its group's host copy, or of a resident parameter)."""
        if not shard.wrapped or shard.master:
            return None
        views, unread = {}, set()
        for seg in shard.segments:
            manager, group, slot = seg.owner
            entry = pending.get(id(group))
            if entry is None:  # a resident parameter on a CPU device
                views[id(seg)] = slot.param.data.view(-1)[seg.start: seg.start + seg.length]
                continue
            if entry.data is None:
                entry.data = _taken(entry)
            if id(group) not in unread:  # (no transfer may read the host copy the update writes)
                manager.store.wait_unread(group.key, Tier.HOST)
                unread.add(id(group))
            begin, end = slot.elements(seg.start, seg.length)
            views[id(seg)] = entry.data[begin: end].view(torch.float32)
        return views

    def wait_copies(self, shard: Shard, pending: dict) -> None:
        """Wait for the host copies of the groups ``shard`` updates in place."""
        for entry in self._in_place(shard, pending):
            if entry.data is None:
                entry.data = _taken(entry)

    def unfetch(self, shard: Shard, pending: dict) -> None:
        """A read for ``shard`` failed: its groups' host copies that are not in memory are
        asked for again next time (``fetch``)."""
        for entry in self._in_place(shard, pending):
            if entry.data is None and entry.manager.home is not Tier.HOST and \
                    entry.manager.store.state(entry.group.key, Tier.HOST) is Residency.ABSENT:
                entry.fetched = False

    def _in_place(self, shard: Shard, pending: dict) -> list[GroupWrite]:
        if not shard.wrapped or shard.master:
            return []
        found = {id(seg.owner.group): pending.get(id(seg.owner.group)) for seg in shard.segments}
        return [e for e in found.values() if e is not None and e.in_place]

    def copies_ready(self, shard: Shard, pending: dict) -> bool:
        """Whether the host copies of the groups ``shard`` updates in place are in memory."""
        return all(entry.data is not None or
                   entry.manager.store.state(entry.group.key, Tier.HOST) is Residency.RESIDENT
                   for entry in self._in_place(shard, pending))

    def after_update(self, shard: Shard, rows: torch.Tensor | None, pending: dict, busy: list | None = None) -> None:
        """``shard`` is updated: put its masters into the groups it covers, and write those
        whose shards are all done (into ``busy`` instead, when given and a pass still uses it)."""
        if not shard.master and not shard.wrapped:
            return  # plain fp32 CPU parameters were updated in place
        if not shard.wrapped:
            for seg in shard.segments:
                if seg.param.grad is not None and seg.length:
                    seg.param.data.view(-1)[seg.start: seg.start + seg.length].copy_(
                        rows[0, seg.offset: seg.offset + seg.length])
            return
        for seg in shard.segments:
            entry = pending.get(id(seg.owner.group))
            if entry is None or entry.in_place:  # updated where it rests: nothing to assemble
                continue
            if entry.data is None:
                entry.data = torch.empty(entry.group.nbytes, dtype=torch.uint8)
            slot = seg.owner.slot
            begin, end = slot.elements(seg.start, seg.length)
            entry.data[begin: end].view(slot.dtype).copy_(rows[0, seg.offset: seg.offset + seg.length])
            entry.written.append((begin, end - begin))
        done = []
        for key in {id(seg.owner.group) for seg in shard.segments}:
            entry = pending.get(key)
            if entry is not None:
                entry.remaining -= 1
                if entry.remaining == 0:
                    done.append(entry)
        for entry in done:
            del pending[id(entry.group)]
            if busy is not None and entry.in_use:
                busy.append(entry)  # a pass still computes with the old bytes: write it later
            else:
                self.finish(entry)

    def finish(self, entry: GroupWrite, current: torch.Tensor | None = None) -> None:
        """Write a group's new bytes to its tier. ``current``: its bytes before the step,
        where some of its parameters were not updated (assembled groups only)."""
        manager, group = entry.manager, entry.group
        if entry.in_place:
            if entry.data is None:
                return  # never read: no shard of it was updated
            manager.coordinator.forget(group.whole or group, replaced="refuse")  # device copies hold the old bytes
            store = manager.store
            if manager.home is Tier.HOST:
                store.mark_dirty(group.key, Tier.HOST)
                return
            if not entry.owed:  # (one held since the last update, its write still owed, is written once)
                self.stats["write_bytes"] += group.nbytes
                count(self.stats, "parameters", written=group.nbytes)
            if self.hold is not None and self.hold(store):
                store.hold_back(group.key, Tier.HOST)  # written home when the room is needed, or at synchronize()
            else:
                store.mark_dirty(group.key, Tier.HOST)
                store.evict(group.key, Tier.HOST)  # written home; the host copy dropped
            return
        data = entry.data
        if current is not None:
            for offset, n in entry.written:
                current[offset: offset + n] = data[offset: offset + n]
            data = current
        manager.write_group(group, data, update=True)
        if manager.home is not Tier.HOST:  # (as the in-place path above counts it)
            count(self.stats, "parameters", written=group.nbytes)

    def finish_released(self, busy: list[GroupWrite], *, force: bool) -> list[GroupWrite]:
        """Write the groups of ``busy`` no pass holds any more (all of them when ``force``:
        the coordinator refuses one still held, naming it); returns those left waiting."""
        waiting = []
        for entry in busy:
            if force or not entry.in_use:
                self.finish(entry)
            else:
                waiting.append(entry)
        return waiting

    def finish_rest(self, pending: dict) -> None:
        """After an update during backward: write the groups some of whose shards got no
        gradient (merging what was not updated from their current bytes)."""
        for entry in list(pending.values()):
            if entry.in_place:
                self.finish(entry)
            elif entry.written:
                self.finish(entry, entry.manager.group_bytes(entry.group))

    def drop_copies(self, entries: list[GroupWrite]) -> None:
        """After an exception: drop the host copies of groups read for an in-place update and
        not written back (their tier keeps the bytes from before the step; a copy held back
        with the last step's bytes, its write owed, is written home first, with whatever of
        this step's update it had taken when the step stopped, which poisons the optimizer).
        Each copy is waited for first, so no read is left landing in a freed slot."""
        for entry in entries:
            if not entry.in_place or not entry.fetched or entry.manager.home is Tier.HOST:
                continue  # (a home copy in host memory was updated where it rests)
            store, key = entry.manager.store, entry.group.key
            if settled(store, key):
                store.evict(key, Tier.HOST)
            if entry.data is not None and not entry.in_use:
                # the host copy was (being) updated while the store held it as clean: a
                # prefetch may have copied it to the device; that copy goes too
                entry.manager.coordinator.forget(entry.group.whole or entry.group, replaced="keep")
                if store.state(key, Tier.DEVICE) is Residency.RESIDENT:
                    store.evict(key, Tier.DEVICE)
            entry.fetched, entry.data = False, None


def settled(store: Any, key: str) -> bool:
    """After an exception: wait for ``key``'s host copy to land or fail; whether one is
    resident to drop. A failed read has freed its copy already (its error was met by the
    caller's step or is moot: the step is being abandoned). A second interrupt goes through
    (the caller has poisoned the optimizer first); a copy never asked for is not read."""
    if store.state(key, Tier.HOST) is Residency.ABSENT:
        return False
    try:
        store.wait(key, Tier.HOST, timeout=60)
    except (OSError, RuntimeError):  # (OffloadIOError, StoreError, BudgetError; TimeoutError is an OSError)
        return False
    return store.state(key, Tier.HOST) is Residency.RESIDENT


def _new(owner: Owner) -> GroupWrite | None:
    """The record that writes ``owner``'s group back after the step, or None when nothing
    needs writing (resident parameters updated where they are)."""
    manager = owner.manager
    mode = wrapped_mode(owner, manager.home, host_compute(manager.config.torch_device))
    if mode is MasterMode.PARAM:
        return None
    return GroupWrite(manager, owner.group, in_place=mode is MasterMode.GROUP)
