"""The gradient sink: a wrapped parameter's gradient leaves the device as soon as autograd
has produced it, into its shards' fp32 accumulators.

A post-accumulate-grad hook on each wrapped parameter adds the new gradient into the
accumulators and sets torch's ``p.grad`` back to None (``_grads`` answers ``p.grad``
afterwards). A shard's accumulator is written to its tier once all of its parameters have
reported in a backward pass (or at the end of the pass); its norms and finiteness are noted
then, and a listener (``update_during_backward``) is told the shard is final. On CUDA the
device-to-host copy runs on a side stream into pinned staging buffers and the add on one
worker thread (any accelerator: ``offload.accel``). With several ranks gradients go through the buckets of ``_reduce`` first.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Protocol

import torch

from .._memory import HEAP_PEAK
from ..accel import Accelerator, accelerator_for
from ..io import PAGE_SIZE, round_up
from ..params import graph_task
from ..store import Tier
from ._ahead import BackwardReads
from ._noted import noted_norms
from ._layout import ParamEntry, Shard
from ._phase import OptimizerPhase, Phase
from ._reduce import Reducer
from ._shards import ShardBook
from ._sizing import largest_grad_copy
from ._staging import GradientCopies
from ._moved import count

__all__ = ["GradientSink", "Listener", "on_drain_thread", "check_dense"]

log = logging.getLogger(__name__)

_DRAIN_THREAD = "offload-grad"  # the worker that adds device gradients into host accumulators


def on_drain_thread() -> bool:
    return threading.current_thread().name.startswith(_DRAIN_THREAD)


class Listener(Protocol):
    """What ``update_during_backward`` hears of a backward (``_early``)."""

    def gradient(self, entry: ParamEntry) -> None:
        """A gradient of ``entry`` is about to be added (refuse one for a final shard)."""

    def shard_final(self, shard: Shard) -> None:
        """Every parameter of ``shard`` has reported in this backward."""

    def device_gradient(self) -> None:
        """A device gradient's copy was queued, on the backward's thread."""

    def give_way(self) -> None:
        """The backward needs host room the listener's queued work holds: finish that work."""


class _OpenBackward(NamedTuple):
    """A backward adding gradients now, whose end-of-backward callback is queued."""
    task: int | None  # its graph task (None where torch cannot tell)


class GradientSink:
    """``before()`` runs ahead of each gradient's add (the optimizer finishes a step's
    update owed to the next forward, which reads these accumulators, lays out parameters
    added since and refreshes written masters)."""

    def __init__(self, book: ShardBook, phase: Phase, stats: dict, before: Callable[[], None]):
        self.book, self.phase, self.stats, self.before = book, phase, stats, before
        self.listener: Listener | None = None
        self.ahead: BackwardReads | None = None  # told of each gradient while no listener is
        self.reducer = Reducer(self, stats)
        self._hooks: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._drains: list[Future] = []
        self._streams: dict[torch.device, Any] = {}
        self._copies: dict[int, GradientCopies] = {}  # per store: buffers for device gradients' copies
        self._backward: _OpenBackward | None = None
        self._hook_ids: dict[int, int] = {}  # id(param) -> our post-accumulate hook's handle id

    def hook(self, entry: ParamEntry) -> None:
        """Take ``entry``'s gradients from now on."""
        if not entry.hooked:
            handle = entry.param.register_post_accumulate_grad_hook(self._on_grad)
            self._hooks.append(handle)
            self._hook_ids[id(entry.param)] = handle.id
            entry.hooked = True

    @property
    def open(self) -> bool:
        """Whether a backward is adding gradients (its end-of-backward callback queued)."""
        return self._backward is not None

    @property
    def pending(self) -> bool:
        """With a device: adds of this backward still queued on the drain thread."""
        return bool(self._drains)

    # -- a gradient arrives ---------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        check_dense(p, grad)  # (before anything is taken: p.grad stays as backward left it)
        entry = self.book.entries[id(p)]
        self._refuse_earlier_hooks(p, entry)
        HEAP_PEAK.sample()  # autograd's gradients are among torch's largest tensors: look while this one lives
        p.grad = None
        self.before()
        if self.listener is None:
            # (within update_during_backward() a new graph task here is a reentrant backward
            # nested in this one, not a new backward after an interrupted one: the block
            # resets itself when its backward fails)
            self.recover_interrupted()
        if self._backward is None:
            self._backward = _OpenBackward(graph_task())
            if self.phase.value is OptimizerPhase.IDLE:
                self.phase.enter(OptimizerPhase.ACCUMULATING)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        acc = accelerator_for(grad.device)
        if entry.owner.manager.partition is not None:
            self.reducer.add(entry, grad)
        elif acc is not None:
            self.drain_device([(p, 0)], grad, acc)
        else:
            self.drain(p, grad)
        if acc is not None and self.listener is not None:
            self.listener.device_gradient()
        elif self.ahead is not None and self.listener is None:
            self.ahead.advance()

    def _refuse_earlier_hooks(self, p: torch.Tensor, entry: ParamEntry) -> None:
        """A post-accumulate-grad hook registered before ours ran on this backward's
        gradient alone: with a sum held from an earlier backward of the step, torch's would
        have seen that sum. Refused there, before anything is added (p.grad is as it was)."""
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if not hooks or next(iter(hooks)) == self._hook_ids.get(id(p)):
            return
        if any(seg.has_grad and not seg.zeroed for seg in entry.segments):
            raise RuntimeError(
                f"a post-accumulate-grad hook on a parameter of shape {tuple(p.shape)} was registered before the "
                "offload optimizer took its gradients: with gradient accumulation it ran on this backward's "
                "gradient alone, where torch's p.grad holds the sum of the step's backwards. Register the hook "
                "after building the optimizer (it then sees the sum), or step after every backward")

    def drain(self, p: torch.Tensor, grad: torch.Tensor, base: int = 0) -> None:
        """Add ``p``'s gradient into its shards' accumulators: element ``i`` of ``p`` is
        ``grad`` (flattened) at ``base + i`` (a reduced slice of a group: ``_reduce``)."""
        flat = grad.reshape(-1)
        entry = self.book.entries[id(p)]
        entry.empty_grad = flat.numel() == 0 and p.numel() == 0
        if self.listener is not None:
            self.listener.gradient(entry)
        if len(entry.segments) > 1 and (entry.owner is None or entry.owner.manager.partition is None):
            _note_whole(entry.segments, flat, whole=base == 0 and flat.numel() == p.numel())
        for seg in entry.segments:
            shard = seg.shard
            acc = self._open(shard)
            at = base + seg.start
            acc[seg.offset: seg.offset + seg.length].add_(flat[at: at + seg.length])
            acc = None  # (_flush may release its buffer: see there)
            seg.has_grad, seg.zeroed = True, False
            shard.drained.add(id(p))
            if len(shard.drained) >= shard.expected:
                self._flush(shard)

    def drain_device(self, items: list[tuple[torch.Tensor, int]], grad: torch.Tensor, acc: Accelerator) -> None:
        """Copy ``grad`` (in ``acc``'s memory) to pinned host memory on a side stream; add it on
        the worker thread into the accumulators of each ``(parameter, base)`` of ``items``
        (see ``drain``)."""
        stream = self._streams.get(acc.device)
        if stream is None:
            stream = self._streams[acc.device] = acc.stream()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=_DRAIN_THREAD)
        segs = next((self.book.segments(p) for p, _ in items if self.book.segments(p)), None)
        if segs is None:
            return  # (several ranks) none of these elements is held here
        copies = self._copies_for(segs[0].shard.store)
        buffer = copies.take(grad.numel() * grad.element_size())
        try:
            host = buffer.view(grad.dtype, (grad.numel(),))
            stream.wait_stream(acc.current_stream())
            with acc.using(stream):
                acc.copy(host, grad.reshape(-1))
                acc.record_stream(grad, stream)
                event = acc.event()
                event.record(stream)
        except BaseException:
            copies.give(buffer)  # (nothing was queued that reads it)
            raise

        def add() -> None:
            try:
                event.synchronize()
                for p, base in items:
                    self.drain(p, host, base)
            finally:
                copies.give(buffer)

        self._drains.append(self._pool.submit(add))

    def _copies_for(self, store: Any) -> GradientCopies:
        copies = self._copies.get(id(store))
        if copies is None:  # (sized from every group of the models on this store, as the budget counts them)
            managers = {id(e.owner.manager): e.owner.manager for e in self.book.entries.values()
                        if e.owner is not None and e.owner.manager.store is store}.values()
            copies = self._copies[id(store)] = GradientCopies(store.staging, max(
                (largest_grad_copy(m.groups, partitioned=m.partition is not None) for m in managers), default=0))
        return copies

    # -- the end of a backward --------------------------------------------------------------
    def sync(self) -> None:
        """Wait for the adds queued on the drain thread; close a backward that was
        interrupted."""
        drains, self._drains = self._drains, []
        for f in drains:
            f.result()
        self.recover_interrupted()

    def recover_interrupted(self) -> None:
        """A backward stopped by an exception (Ctrl-C) never runs the end-of-backward
        callback it queued: close the accumulators it left open, keeping their partial sums
        as torch keeps ``p.grad`` after an interrupted backward (``zero_grad`` drops them)."""
        if self._backward is not None and graph_task() != self._backward.task:
            self._backward = None
            self.reducer.clear()  # (several ranks: the other ranks' job failed too)
            self._closed_backward()
            self.flush_all()

    def _end_of_backward(self) -> None:
        self._backward = None
        self.reducer.reduce_pending()
        self._closed_backward()
        if self._pool is not None:
            self._drains.append(self._pool.submit(self.flush_all))
        else:
            self.flush_all()

    def _closed_backward(self) -> None:
        if self.phase.value is OptimizerPhase.ACCUMULATING:
            self.phase.enter(OptimizerPhase.IDLE)

    def flush_all(self) -> None:
        for shard in self.book.shards:
            if shard.acc is not None:
                self._flush(shard)

    # -- accumulators ---------------------------------------------------------------------------
    def _open(self, shard: Shard) -> torch.Tensor:
        if shard.acc is not None:
            return shard.acc
        store = shard.store
        if shard.grad_home is Tier.HOST:
            acc = store.wait(shard.grad_key, Tier.HOST)
            if not shard.grad_valid:
                acc.zero_()
            else:
                _settle(shard, acc)
        else:
            self._room(store, round_up(shard.numel * 4, PAGE_SIZE))
            shard.acc_buffer = store.staging.acquire(shard.numel * 4)
            acc = shard.acc_buffer.view(torch.float32, (shard.numel,))
            if shard.grad_valid:  # an earlier backward of this cycle: add to it
                # (read straight into the accumulator: a host copy beside it would need room
                # that reads ahead may have taken since)
                store.read_into(shard.grad_key, shard.acc_buffer.bytes, priority=0).wait()
                self.stats["read_bytes"] += shard.numel * 4
                count(self.stats, "gradients", read=shard.numel * 4)
                _settle(shard, acc)
            else:
                acc.zero_()
        shard.acc = acc
        return acc

    def _flush(self, shard: Shard) -> None:
        acc = shard.acc
        for seg in shard.segments:  # per parameter, for p.grad's norms (_grads)
            seg.sumsq, seg.maxabs = noted_norms(acc[seg.offset: seg.offset + seg.length])
            seg.approx = False
        shard.sumsq = sum(seg.sumsq for seg in shard.segments)
        shard.maxabs = max((seg.maxabs for seg in shard.segments), default=0.0)
        shard.finite = math.isfinite(shard.maxabs)  # (a sum of squares can overflow where no element does)
        if shard.grad_home is Tier.HOST:
            shard.store.mark_dirty(shard.grad_key, Tier.HOST)
        else:
            self._room(shard.store, round_up(shard.numel * 4, PAGE_SIZE))  # (the put stages the sum for NVMe)
            shard.store.put(shard.grad_key, acc, shard.grad_home)
            # (no view of the buffer may outlive its release: the pool would not reuse it, and an
            # I/O thread making room meanwhile would drop it as held by someone else)
            shard.acc = acc = None
            shard.store.staging.release(shard.acc_buffer)
            shard.acc_buffer = None
            self.stats["write_bytes"] += shard.numel * 4
            count(self.stats, "gradients", written=shard.numel * 4)
        shard.acc = None
        shard.grad_valid = True
        shard.drained.clear()
        if self.listener is not None and shard.wrapped:
            self.listener.shard_final(shard)

    def _room(self, store: Any, nbytes: int) -> None:
        """Before taking ``nbytes`` of ``store``'s pool: state rows read ahead for the update
        give way where the pool is short (``_ahead``: they are clean, a drop costs a read),
        then parameter groups an update held in host memory (``store.shed_behind``)."""
        pool = store.staging
        if self.ahead is not None and pool.budget - pool.in_use_bytes < nbytes:
            self.ahead.shed(store, nbytes)
        short = nbytes - (pool.budget - pool.in_use_bytes)
        if short > 0:  # (held parameter groups go home: their room frees as they land)
            store.shed_behind(short)
        if self.listener is not None and pool.budget - pool.in_use_bytes < nbytes:
            # (the update during backward holds rows read for its queued shards, whose turn
            # comes in a later gradient hook: waiting for their room here would wait for ever)
            self.listener.give_way()

    def reset(self) -> None:
        """Drop every gradient held for wrapped parameters, with its noted norms."""
        self.sync()
        self.reducer.clear()
        for shard in self.book.shards:
            shard.grad_valid, shard.sumsq, shard.maxabs, shard.finite = False, 0.0, 0.0, True
            for seg in shard.segments:
                seg.has_grad, seg.zeroed, seg.whole = False, False, None

    def close(self) -> None:
        """Stop taking gradients. Adds still queued are waited for; accumulators a stopped
        backward left open are dropped, not written (the optimizer's states go with them, and
        the model's store may be closed already)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        drains, self._drains = self._drains, []
        for f in drains:
            if f.exception() is not None:
                log.warning("offload optimizer: a gradient add failed before close: %r", f.exception())
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for copies in self._copies.values():
            copies.close()
        self._copies.clear()
        self._backward, self.listener = None, None
        for shard in self.book.shards:
            if shard.acc_buffer is not None and not shard.store.closed:
                shard.store.staging.release(shard.acc_buffer)
            shard.acc, shard.acc_buffer = None, None

    def shutdown_quietly(self) -> None:
        """From ``__del__``: stop the drain thread without waiting."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _note_whole(segs: list, flat: torch.Tensor, *, whole: bool) -> None:
    """A split parameter's gradient arrives: where it is its first since the gradient was
    dropped and ``flat`` is all of it, its squared norm as torch's ``vector_norm`` takes it
    over the whole (what ``clip_grad_norm_`` takes per parameter; the pieces' noted sums
    differ from it in the last bits). A gradient added to a held one has no whole norm (one
    held as zeros by ``zero_grad(set_to_none=False)`` does: the sum is ``flat`` to the bit),
    nor one of another dtype (torch's bits are promised for fp32; a copy in fp32 would cost
    memory the budgets do not count)."""
    value = None
    if whole and flat.dtype == torch.float32 and not any(seg.has_grad and not seg.zeroed for seg in segs):
        value = float(torch.linalg.vector_norm(flat)) ** 2
        if not math.isfinite(value):  # (the pieces' sums fall back to fp64, or carry the NaN)
            value = None
    for seg in segs:
        seg.whole = value


def _settle(shard: Shard, acc: torch.Tensor) -> None:
    """Before a backward adds into a kept sum: the slices of parameters whose gradient was
    dropped (``p.grad = None``) become zero, and factors noted on it (``p.grad.mul_(c)``,
    clipping) are applied, as torch's in-place calls would have."""
    for seg in shard.segments:
        part = acc[seg.offset: seg.offset + seg.length]
        if not seg.has_grad:
            part.zero_()
        elif seg.scale != 1.0:
            part.mul_(seg.scale)
            seg.whole = None  # (torch would take the norm of the product, not scale the norm)
        seg.scale = 1.0


def check_dense(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Refuse a sparse gradient (torch's SGD takes one; offload's shards hold dense sums)."""
    if grad.layout is not torch.strided:
        raise RuntimeError(
            f"offload's optimizers take dense gradients; a parameter of shape {tuple(p.shape)} got a "
            f"{str(grad.layout).removeprefix('torch.')} one (nn.Embedding(sparse=True), "
            "F.embedding(sparse=True)). Build the embedding with sparse=False")
