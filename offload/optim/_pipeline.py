"""The step as a pipeline over shards: the store is asked for the states (and gradients) of
the shards ahead while shard ``i`` is updated by the update rule and shard ``i - 1`` is
written back; the host budget bounds how many are in flight (a fetch that does not fit
waits in the store for a write to finish). After an exception the host copies read ahead
are dropped and, if some shard was updated, the optimizer is poisoned."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Any, Callable

import torch

from .._memory import HEAP_PEAK
from ..store import Residency, Tier
from ._noted import noted_norms, renote
from ._formats import dither_at
from ._layout import SHARDS_IN_FLIGHT, Segment, Shard
from ._moved import count, count_states
from ._phase import Phase
from ._writeback import WriteBack, settled

__all__ = ["Pipeline", "READ_AHEAD"]

READ_AHEAD = 2  # shards read ahead of the one being updated; the host budget may hold fewer back
# shards whose states are being written home while the next are read: the rest of the
# shards in flight that the plan counts (offload.optim's sizing)
WRITES_IN_FLIGHT = SHARDS_IN_FLIGHT - READ_AHEAD - 1
if WRITES_IN_FLIGHT < 1:
    raise ImportError(f"SHARDS_IN_FLIGHT ({SHARDS_IN_FLIGHT}) must leave room for a write-back beside the shard "
                      f"being updated and the {READ_AHEAD} read ahead")

# update(group_index, params, grads, state_rows, steps, grad_scale, groups): one call of the
# update rule over fp32 CPU tensors of one torch param group (``_rules``); ``groups``: the
# param groups' settings as the step saw them (None: the optimizer's current ones)
Update = Callable[[int, list, list, list, list, float, "list[dict] | None"], None]


class Pipeline:
    def __init__(self, update: Update, row_count: Callable[[int, "list[dict] | None"], int], writeback: WriteBack,
                 phase: Phase, stats: dict, log: Callable[[str, Shard], None],
                 reserve: Callable[[Any], int] = lambda store: 0, scratch: Callable[[Any], Any] = lambda store: None):
        self.update, self.row_count, self.writeback = update, row_count, writeback
        self.scratch = scratch  # a store's buffer that coded shards are decoded into (ShardBook.scratch)
        self.reserve = reserve  # host bytes of a store's pool reads ahead leave free (ShardBook.reserved)
        self.phase, self.stats, self.log = phase, stats, log
        self.writing: deque = deque()  # (store, key) of state rows being written home, oldest first

    def run(self, work: list[Shard], grad_scale: float, pending: dict | None = None) -> None:
        """Update ``work`` in order; ``pending``: group writes planned already (else planned here)."""
        issued: set[int] = set()
        started = 0  # shards whose update has begun
        pending = self.writeback.plan(work) if pending is None else pending
        try:
            for i, shard in enumerate(work):
                for nxt in work[i: i + 1 + READ_AHEAD]:
                    if id(nxt) in issued:
                        continue
                    if nxt is not shard and (self.writes_backlogged() or not self.room_beside_compute(nxt, pending)):
                        self.log("read_later", nxt)
                        break  # read it later, once a write has landed: the update goes on meanwhile
                    self.bound_writes()  # (the shard to update now, not read yet: wait for the room)
                    self.issue(nxt, issued, pending)
                started = i + 1
                self.process(shard, grad_scale, pending)
        except BaseException:
            if started:  # first: a second interrupt during the clean-up below must not lose it
                self.phase.poison(f"step() stopped after updating {started} of {len(work)} shards")
            self.abandon(work[max(started - 1, 0):], issued)
            self.writeback.drop_copies(list(pending.values()))
            raise

    def issue(self, shard: Shard, issued: set[int], pending: dict) -> None:
        """Ask for what updating ``shard`` reads, once."""
        if id(shard) in issued:
            return
        issued.add(id(shard))
        self.writeback.fetch(shard, pending)
        if shard.home is Tier.HOST:
            return
        self.log("read", shard)
        for key in shard.host_reads:
            shard.store.fetch(key, Tier.HOST)
        self.stats["read_bytes"] += shard.bytes_in_flight
        if shard.rows:
            count_states(self.stats, shard, read=True)
        if shard.reads_grad:
            count(self.stats, "gradients", read=shard.grad_bytes)

    def room_beside_compute(self, shard: Shard, pending: dict, *, backward: int = 0) -> bool:
        """Whether reading ``shard`` leaves the host room that compute's transfers on a
        device need (a parameter group's staging, gradient copies) and the step's own
        write-back of a parameter group assembled from master rows (its staging for NVMe). A
        read ahead of its need waits for that room: holding it, a forward, a backward or the
        write-back waiting for a staging buffer would find nothing in flight that frees one.
        ``backward``: what the rest of a backward still takes from the pool (its gradients)."""
        reserve = self.reserve(shard.store) + backward
        if not reserve or shard.home is Tier.HOST:
            return True
        pool = shard.store.staging
        return pool.budget - pool.in_use_bytes >= self.read_room(shard, pending) + reserve

    def read_room(self, shard: Shard, pending: dict) -> int:
        """Host pool bytes reading ``shard`` takes: its rows and gradient in whole pages, as the
        pool hands them out, and the group copies it reads (``WriteBack.copy_bytes``)."""
        if shard.home is Tier.HOST:
            return self.writeback.copy_bytes(shard, pending)
        host = shard.store.tiers[Tier.HOST]
        return (host.slot_size(shard.state_bytes) if shard.rows else 0) + \
            (host.slot_size(shard.grad_bytes) if shard.reads_grad else 0) + self.writeback.copy_bytes(shard, pending)

    def in_memory(self, shard: Shard, pending: dict) -> bool:
        """Whether everything updating ``shard`` reads is in host memory now."""
        return all(shard.store.state(k, Tier.HOST) is Residency.RESIDENT for k in shard.host_reads) and \
            self.writeback.copies_ready(shard, pending)

    def bound_writes(self) -> None:
        """Before reading the shard to update next: wait for the oldest write-backs beyond
        ``WRITES_IN_FLIGHT`` (shards further ahead are read later instead:
        ``writes_backlogged``). The store frees a written shard's host copy only when its
        write lands; where the disk writes slower than the update runs, copies would pile up
        to the host budget (seven shards at once on GPT-2 124M) and the pool grow step after
        step; the plan counts ``SHARDS_IN_FLIGHT``, and the disk is the limit either way."""
        while len(self.writing) > WRITES_IN_FLIGHT:
            store, key = self.writing.popleft()
            if not store.closed and key in store:
                waited = time.perf_counter()
                store.wait_stored(key, Tier.HOST)
                self.stats["wait_seconds"] += time.perf_counter() - waited

    def writes_backlogged(self) -> bool:
        """Whether reading another shard now would hold more than the shards in flight."""
        self._forget_landed()
        return len(self.writing) > WRITES_IN_FLIGHT

    def _forget_landed(self) -> None:
        """Drop the oldest entries whose write has landed (an update during backward
        writes without reading ahead through ``run``: the list would grow every step)."""
        while self.writing:
            store, key = self.writing[0]
            if not store.closed and key in store and store.state(key, Tier.HOST) is Residency.STORING:
                return
            self.writing.popleft()

    def abandon(self, rest: list[Shard], issued: set[int]) -> None:
        """After an exception: drop the host copies of the shard being updated and of those
        read ahead (they would hold the host budget); their home keeps the states from
        before the step."""
        for shard in rest:
            if id(shard) not in issued:
                continue
            issued.discard(id(shard))  # (abandoned once: a second call reads nothing again)
            for key in shard.host_reads:
                if settled(shard.store, key):
                    shard.store.evict(key, Tier.HOST)

    def process(self, shard: Shard, grad_scale: float, pending: dict, *, busy: list | None = None,
                where: str = "step", groups: list[dict] | None = None) -> None:
        """Update ``shard`` (its reads issued) and start writing it back: states to their
        tier, parameter groups whose shards are all done to the parameter tier (into
        ``busy`` instead when given and the group is in use by a pass). ``where``: what the
        trace says the update ran in; ``groups``: the settings of the step it belongs to."""
        waited = time.perf_counter()
        rows = shard.store.wait(shard.state_key, Tier.HOST) if shard.rows else None
        grads = shard.store.wait(shard.grad_key, Tier.HOST) if shard.wrapped else None
        views = self.writeback.views(shard, pending)
        self.stats["wait_seconds"] += time.perf_counter() - waited
        stored, packing = rows, shard.packing
        if shard.packed:  # coded rows: updated in fp32, coded again in place (``_formats``)
            rows = self.scratch(shard.store).view(torch.float32, (shard.rows, shard.numel))
            packing.decode(stored, rows)
        self.log("update_start", shard)
        HEAP_PEAK.sample()
        self._update_shard(shard, rows, grads, grad_scale, views, where, groups)
        if shard.packed:
            packing.round_in_place(rows, [(seg.offset, seg.length, dither_at(seg.number, int(seg.step), seg.start))
                                          for seg in shard.segments])  # (a bf16 master: the parameters get it)
            shard.store.wait_unread(shard.state_key, Tier.HOST)  # (no transfer reads what is coded over)
            # before any parameter is written: a failure here leaves the step's states and weights
            # both old (coding reads the master row and leaves it as it is)
            packing.encode(rows, stored)
        self.log("update_end", shard)
        self.writeback.after_update(shard, rows, pending, busy)
        if shard.home is not Tier.HOST:
            self.log("write", shard)
            if shard.rows:
                shard.store.mark_dirty(shard.state_key, Tier.HOST)
                shard.store.evict(shard.state_key, Tier.HOST)
                self.writing.append((shard.store, shard.state_key))
                self._forget_landed()
                self.stats["write_bytes"] += shard.state_bytes
                count_states(self.stats, shard, read=False)
            if shard.reads_grad:
                shard.store.evict(shard.grad_key, Tier.HOST)
        elif shard.rows:
            shard.store.mark_dirty(shard.state_key, Tier.HOST)

    def _update_shard(self, shard: Shard, rows: torch.Tensor | None, grads: torch.Tensor | None,
                      grad_scale: float, views: dict | None, where: str, groups: list[dict] | None) -> None:
        # one call per torch param group and gradient factor (p.grad.mul_(c), clipping). The
        # factor multiplies the staged gradients first, as torch's p.grad.mul_ would have: folded
        # into the kernel's grad_scale (a division) it rounds differently in the last bit
        by_group: dict[tuple[int, float], list[Segment]] = defaultdict(list)
        for seg in shard.segments:
            if seg.length and (seg.has_grad if shard.wrapped else seg.param.grad is not None):
                by_group[seg.group_index, seg.scale].append(seg)
        temp = None  # fp32 CPU copies of plain gradients that are not
        tracer = shard.store.tracer
        began = tracer.now() if tracer is not None else 0.0
        try:
            for (gi, factor), segs in by_group.items():
                if factor == 0.0:  # p.grad.mul_(0): as torch's (an inf element becomes NaN)
                    for seg in segs:
                        part = grads[seg.offset: seg.offset + seg.length].mul_(0.0)
                        if shard.grad_home is Tier.HOST:  # (the resting sum itself: its books follow)
                            seg.sumsq, seg.maxabs = noted_norms(part)
                            seg.scale, seg.whole = 1.0, None
                    factor = 1.0
                elif factor != 1.0:  # (only offloaded gradients take noted factors)
                    for seg in segs:
                        grads[seg.offset: seg.offset + seg.length].mul_(factor)
                temp = self._update_group(shard, gi, segs, rows, grads, grad_scale, temp, views, groups)
                if shard.wrapped and shard.grad_home is Tier.HOST and (factor != 1.0 or grad_scale != 1.0):
                    _unscaled_in_place(segs, grad_scale / factor, grad_scale)  # (the resting sum was changed)
        finally:
            if temp is not None:
                shard.store.staging.release(temp)
            if tracer is not None:
                tracer.span(f"update shard {shard.index}", "optimizer", began, tracer.now(), "optimizer",
                            {"elements": shard.numel, "during": where})

    def _update_group(self, shard: Shard, gi: int, segs: list[Segment], rows, grads, grad_scale: float,
                      temp: Any, views: dict | None, groups: list[dict] | None) -> Any:
        """One call of the update rule for the segments of torch param group ``gi``."""
        # (the rows the settings this update runs with use: a prefix of those laid out)
        used = self.row_count(gi, groups)
        if used > len(shard.names):
            raise ValueError(f"param group {gi}'s settings need {used} state rows; it was laid out with "
                             f"{list(shard.names)}: build the optimizer with the settings the run will use")
        params, gs, state_rows, steps = [], [], [[] for _ in range(used)], []
        first = 1 if shard.master else 0
        for seg in segs:
            a, b = seg.offset, seg.offset + seg.length
            if shard.master:
                params.append(rows[0, a:b])
            elif views is not None:
                params.append(views[id(seg)])
            else:
                params.append(seg.param.data.view(-1)[seg.start: seg.start + seg.length])
            if shard.wrapped:
                gs.append(grads[a:b])
            else:
                g = seg.param.grad.reshape(-1)[seg.start: seg.start + seg.length]
                if g.dtype != torch.float32 or g.device.type != "cpu":
                    if temp is None:  # from the pool: reused across steps
                        temp = shard.store.staging.acquire(shard.numel * 4)
                    dest = temp.view(torch.float32, (shard.numel,))[a:b]
                    dest.copy_(g)
                    g = dest
                gs.append(g)
            for r in range(len(state_rows)):
                state_rows[r].append(rows[first + r, a:b])
            steps.append(seg.step)
        self.update(gi, params, gs, state_rows, steps, grad_scale, groups)
        # (written through .data, which torch's version check does not see: a graph saved before
        # the step would give the new values where torch refuses; streamed groups count their writes)
        for seg in segs:  # (one tensor a call: torch before 2.5 takes no list)
            if not shard.wrapped or seg.owner.group.resident:
                torch.autograd.graph.increment_version(seg.param)
        for group in {id(s.owner.group): s.owner for s in segs if shard.wrapped and s.owner.group.resident}.values():
            group.manager.coordinator.note_updated(group.group)  # (copies taken before, as state_dict's, refuse)
        return temp


def _unscaled_in_place(segs: list[Segment], divisor: float, loss_scale: float) -> None:
    """The update multiplied these segments' resting gradient sums by their factor and
    divided them by the loss scale, in place (torch's fused kernels unscale their grads; SGD
    does the same), ``divisor`` in all: p.grad's books follow,
    so it still shows the clipped, unscaled gradient, and the next backward adds to the
    loss-scaled sum."""
    for seg in segs:
        seg.sumsq /= divisor * divisor
        seg.maxabs /= abs(divisor)
        seg.scale, seg.whole, seg.approx = loss_scale, None, True
    renote(segs[0].shard)
