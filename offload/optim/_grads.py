"""``p.grad`` of a wrapped parameter whose gradient an offload optimizer holds.

The optimizer adds each gradient of a wrapped parameter into its fp32 accumulators as
autograd produces it and sets ``p.grad`` back to None (``_optimizer``'s docstring). Code
written for torch reads ``p.grad`` anyway: ``torch.nn.utils.clip_grad_norm_`` (what
Accelerate's and HF Trainer's clipping call), per-parameter norms in a log,
``model.zero_grad()``. ``params`` asks the optimizer for such a ``p.grad`` (see
``params._gradients``), and it answers with an :class:`OffloadedGrad`: a tensor of the
gradient's shape and device whose elements rest in the accumulators. Its dtype is theirs,
fp32, whatever the parameter's (a bf16 model's gradients are summed in fp32: norms and
clipping then see fp32 values, as DeepSpeed's bf16 does, and torch.amp's GradScaler, which
refuses fp16 gradients, accepts them).

- Its 2-norm and inf-norm are the ones noted when the accumulator was written: no pass
  over the tier (``clip_grad_norm_`` reads nothing).
- Scaling it in place by a number (``g.mul_(c)``, ``g.div_(c)``, ``g.zero_()``: how torch
  clips; and ``torch.amp.GradScaler``'s unscale, whose overflow check reads the noted
  maxima) is noted per segment and applied inside the next ``step()`` (or before the next
  backward adds to it) where one multiplication there rounds as torch's calls in turn do:
  a single factor noted, or powers of two beside it (``_exact_later``). A division by
  another number, or a second such factor, is computed on the elements at once; p.grad's
  2-norm under such a factor is taken of the products, read (torch's norm is of those),
  and the optimizer's clip applies the factor first (``settle``);
  ``p.grad = None`` drops it; ``p.grad = t`` replaces it.
- Like torch's, it stays after ``step()`` until ``zero_grad()`` or ``p.grad = None``; a
  backward without either adds to it.
- Any other call runs on a copy of its elements (read from the tier); a call that writes
  them in place has its result written back; a result that views the copy refuses writes
  (``_gradcopies.CopyView``), which would be lost.

It refuses use once ``zero_grad()`` has dropped the gradient it stood for, within
``update_during_backward()`` (the update runs during backward), and with several ranks
(each holds a slice: use ``opt.clip_grad_norm_``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..store import Tier
from ._gradreads import GradientReads, read_sum
from ._gradview import OffloadedGrad, _plain
from ._noted import held_norm, noted_norms, renote

__all__ = ["GradientBook"]

class GradientBook:
    """The optimizer's side of ``p.grad`` (module docstring): views, norms, scales, reads
    and writes of the gradients in its accumulators. During backward a parameter's slice of
    an open accumulator is already final once its post-accumulate-grad hooks run (torch's
    own p.grad is final then too), so hooks may read and write it there."""

    def __init__(self, book: Any, sink: Any, *, loss_factor: Any, in_backward_update: Any, closed: Any,
                 settle: Any):
        # book: the ShardBook (shards, each parameter's segments); sink: the GradientSink
        # (CUDA adds still queued); loss_factor(): the loss scale the sums are in units of;
        # in_backward_update(): update_during_backward() is under way; closed(): the
        # optimizer is closed; settle(): finish a step's update owed to the next forward
        # (before a view's call: the step read the gradient as it was)
        self.book, self.sink, self._loss_factor = book, sink, loss_factor
        self._in_backward_update, self._closed, self._settle = in_backward_update, closed, settle
        self.epoch = 0  # advanced when zero_grad() clears the gradients
        self._views: dict[int, OffloadedGrad] = {}
        self._reads = GradientReads(sink.stats)

    def cleared(self) -> None:
        self.epoch += 1
        self._reads.forget()
        for entry in self.book.entries.values():
            entry.empty_grad = False
        self._views.clear()
        for shard in self.book.shards:
            for seg in shard.segments:
                seg.scale, seg.sumsq, seg.maxabs, seg.whole = 1.0, 0.0, 0.0, None

    def forget_reads(self) -> None:
        self._reads.forget()

    def hide(self, param: torch.Tensor | None = None) -> None:
        """Views of ``param``'s gradient (every view: None) refuse use from now on: it is
        dropped (a step's update owed to the next forward still reads it, then drops it)."""
        if param is None:
            self.epoch += 1
            self._views.clear()
        else:
            self._views.pop(id(param), None)
        entries = list(self.book.entries.values()) if param is None else [self.book.entries.get(id(param))]
        for entry in entries:  # (a 0-element parameter's p.grad goes as the others' do)
            if entry is not None:
                entry.empty_grad = False

    def zero_kept(self) -> None:
        """``zero_grad(set_to_none=False)``: the held gradients become zeros, still held."""
        for shard in self.book.shards:
            if not shard.wrapped or not shard.holds_gradient:
                continue
            if shard.grad_home is Tier.HOST:
                shard.store.wait(shard.grad_key, Tier.HOST).zero_()
                shard.store.mark_dirty(shard.grad_key, Tier.HOST)
            else:
                shard.store.put(shard.grad_key, torch.zeros(shard.numel), shard.grad_home)
            for seg in shard.segments:
                seg.scale, seg.sumsq, seg.maxabs, seg.whole = 1.0, 0.0, 0.0, None
                seg.zeroed = seg.has_grad
            renote(shard)

    def loss_scale_changed(self, old: float, new: float) -> None:
        """Held sums are in units of the loss scale: when it changes, their factors follow,
        so p.grad stays the same gradient and the next backward adds in the new units."""
        for shard in self.book.shards:
            for seg in shard.segments:
                if seg.has_grad and not seg.zeroed:  # (zeros stay zeros: the next sum is still whole)
                    seg.scale *= new / old

    def view(self, param: torch.Tensor) -> OffloadedGrad | None:
        if self.sink.pending:  # (CUDA: adds of this backward still on the drain thread)
            self.sink.sync()
        segs = self.book.segments(param)
        if not segs:  # (a 0-element parameter holds nothing: torch's p.grad is an empty tensor once it got one)
            entry = self.book.entries.get(id(param))
            return torch.zeros(param.shape, device=param.device) if entry is not None and entry.empty_grad else None
        if not any(seg.has_grad for seg in segs):
            return None
        view = self._views.get(id(param))
        if view is None:
            with _plain():  # (NaN: a read of the placeholder itself could never pass for a gradient)
                base = torch.full((), math.nan, dtype=torch.float32, device=param.device).expand(param.shape)
            view = torch.Tensor._make_subclass(OffloadedGrad, base, False)
            view._book, view._param, view._epoch = self, param, self.epoch
            self._views[id(param)] = view
        return view

    def assign(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """``param.grad = value``: None drops what is held for it, a tensor replaces it."""
        view = self.view(param)
        if value is None:  # (needs no reduction: allowed with several ranks too)
            if view is not None:
                self.drop(param)
            return
        self.check_param(param)
        if value is not view:
            self.write(param, value)

    def check(self, view: OffloadedGrad) -> None:
        self._settle()
        if view._epoch != self.epoch or self._closed() or id(view._param) not in self._views:
            raise RuntimeError("this p.grad stood for a gradient that zero_grad() or p.grad = None has dropped (or "
                               "the optimizer is closed): read p.grad again")
        self.check_param(view._param)

    def check_param(self, param: torch.Tensor) -> None:
        """Refuse where ``p.grad`` of a wrapped parameter cannot be served."""
        if self._in_backward_update():
            raise RuntimeError("p.grad from update_during_backward() until step(): the backward in that block "
                               "updates the weights with the gradients as it makes them, so no call "
                               "(clip_grad_norm_ included) may read or change them in between. To clip, leave "
                               "out update_during_backward(): the default update in the next forward overlaps "
                               "the same work, clipping included")
        if self.book.partition() is not None:
            raise RuntimeError("p.grad of an offloaded parameter with several ranks: each rank holds a slice of "
                               "the gradient, so norms and clipping over p.grad would be per rank. Use "
                               "opt.clip_grad_norm_(max_norm), which reduces over the ranks")
        self.sink.sync()  # (CUDA: the adds of this backward's gradients so far)

    # -- what a view's calls do --------------------------------------------------------
    def _segments(self, param: torch.Tensor) -> list:
        return self.book.segments(param)

    def _loss_scale(self) -> float:
        return self._loss_factor()

    def norm(self, param: torch.Tensor, order: float) -> float:
        segs = [seg for seg in self._segments(param) if seg.has_grad]
        if any(seg.shard.acc is not None for seg in segs):  # during backward: not noted yet
            values = self.values(param)
            return float(torch.linalg.vector_norm(values, order, dtype=torch.float64))
        if any(seg.approx for seg in segs):  # (the step changed the sum in place: its notes are near only)
            return float(torch.linalg.vector_norm(self.values(param), order))
        if order == 2.0:
            if any(seg.scale != 1.0 and not _pow2(seg.scale) for seg in segs):  # (torch's is of the products)
                return float(torch.linalg.vector_norm(self.values(param)))
            return held_norm(segs) / self._loss_scale()
        return max((seg.maxabs * abs(seg.scale) for seg in segs), default=0.0) / self._loss_scale()

    def finite(self, param: torch.Tensor) -> bool:
        if any(seg.shard.acc is not None for seg in self._segments(param)):
            return bool(torch.isfinite(self.values(param)).all())
        return all(math.isfinite(seg.maxabs) for seg in self._segments(param) if seg.has_grad)

    def scale(self, param: torch.Tensor, value: float, *, divide: bool = False) -> None:
        """``p.grad.mul_(value)`` (``div_`` when ``divide``), torch's elements to the bit:
        noted where one multiplication inside the step gives them, else computed now."""
        factor = 1.0 / value if divide else value
        segs = self._segments(param)
        if (divide and not _pow2(value)) or not all(_exact_later(seg.scale, factor) for seg in segs
                                                    if seg.shard.acc is None and seg.has_grad):
            values = self.values(param)
            self.write(param, values.div_(value) if divide else values.mul_(value))
            return
        for seg in segs:
            if seg.shard.acc is not None:  # an open accumulator: in place (its flush notes it)
                seg.shard.acc[seg.offset: seg.offset + seg.length].mul_(factor)
                seg.whole = None
            else:
                seg.scale *= factor

    def settle(self) -> None:
        """Apply to the held sums the factors noted on them that are not powers of two, each
        shard read and written once: the norm ``opt.clip_grad_norm_`` takes next is of those
        products (the noted norm times the factor only approximates it), and its factor then
        multiplies them again, as torch's calls in turn do. Notes a step left near only
        (``approx``) are taken again from the sums."""
        if self.book.partition() is not None:  # (a rank holds slices: p.grad is refused there)
            return
        for shard in self.book.shards:
            segs = [seg for seg in shard.segments if seg.has_grad and seg.scale != 1.0 and not _pow2(seg.scale)]
            near = [seg for seg in shard.segments if seg.has_grad and seg.approx and seg not in segs]
            if not shard.wrapped or shard.acc is not None or not (segs or near):  # (an open sum takes factors)
                continue
            acc = read_sum(shard)
            for seg in near:
                seg.sumsq, seg.maxabs = noted_norms(acc[seg.offset: seg.offset + seg.length])
                seg.approx = False
            if not segs:
                renote(shard)
                continue
            for seg in segs:
                part = acc[seg.offset: seg.offset + seg.length].mul_(seg.scale)
                seg.scale, seg.whole, seg.approx = 1.0, None, False
                seg.sumsq, seg.maxabs = noted_norms(part)
            if shard.grad_home is Tier.HOST:
                shard.store.mark_dirty(shard.grad_key, Tier.HOST)
            else:
                shard.store.put(shard.grad_key, acc, shard.grad_home)
            renote(shard)

    def values(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of the gradient's elements, in the parameter's shape, fp32 (on the CPU)."""
        flat = torch.zeros(param.numel(), dtype=torch.float32)
        for seg in self._segments(param):
            if seg.has_grad:
                acc = seg.shard.acc if seg.shard.acc is not None else self._reads.sum_of(seg.shard)
                flat[seg.start: seg.start + seg.length] = acc[seg.offset: seg.offset + seg.length] * seg.scale
        return flat.div_(self._loss_scale()).view(param.shape)

    def write(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Make ``value`` the gradient (``p.grad = value`` or an in-place call's result)."""
        with _plain():
            if tuple(value.shape) != tuple(param.shape):
                raise RuntimeError(f"assigned grad has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")
            flat = value.detach().reshape(-1).float().cpu()
        entry = self.book.entries.get(id(param))
        if entry is not None and param.numel() == 0:
            entry.empty_grad = True
        for seg in self._segments(param):
            part = flat[seg.start: seg.start + seg.length] * self._loss_scale()  # held as backward leaves it
            if seg.shard.acc is not None:
                seg.shard.acc[seg.offset: seg.offset + seg.length] = part
                seg.has_grad, seg.zeroed, seg.scale, seg.whole = True, False, 1.0, None
            else:
                self._rewrite(seg, part)

    def zero(self, param: torch.Tensor) -> None:
        """``p.grad.zero_()``: zeros, still held; nothing is written where they are zeros
        already (torch's ``zero_grad(set_to_none=False)`` after the optimizer's own)."""
        segs = self._segments(param)
        if segs and all(seg.has_grad and seg.zeroed and seg.scale == 1.0 for seg in segs):
            return
        self.write(param, torch.zeros(param.shape))
        for seg in segs:  # (the next gradient added is the sum to the bit: _sink._note_whole)
            seg.zeroed = True

    def drop(self, param: torch.Tensor) -> None:
        """``p.grad = None``: its slices are zeroed when their accumulator is next opened."""
        entry = self.book.entries.get(id(param))
        if entry is not None:
            entry.empty_grad = False
        for seg in self._segments(param):
            if seg.shard.acc is not None:
                seg.shard.acc[seg.offset: seg.offset + seg.length].zero_()
            seg.has_grad, seg.zeroed, seg.scale, seg.sumsq, seg.maxabs, seg.whole = False, False, 1.0, 0.0, 0.0, None
            if seg.shard.acc is None and not any(s.has_grad for s in seg.shard.segments):
                seg.shard.grad_valid = False
            renote(seg.shard)
        self._views.pop(id(param), None)

    def _rewrite(self, seg: Any, part: torch.Tensor) -> None:
        shard = seg.shard
        acc = read_sum(shard)  # the resting tensor in host memory, else a copy put back below
        if not shard.grad_valid:  # its stale sums are zeroed by the next backward; so here
            acc.zero_()
            for other in shard.segments:
                other.has_grad, other.zeroed, other.scale = False, False, 1.0
                other.sumsq, other.maxabs, other.whole = 0.0, 0.0, None
        else:
            for other in shard.segments:  # (dropped ones: zero, as the next backward would make them)
                if not other.has_grad:
                    acc[other.offset: other.offset + other.length].zero_()
        acc[seg.offset: seg.offset + seg.length] = part
        seg.has_grad, seg.zeroed, seg.scale, seg.whole, seg.approx = True, False, 1.0, None, False
        seg.sumsq, seg.maxabs = noted_norms(part)
        if shard.grad_home is Tier.HOST:
            shard.store.mark_dirty(shard.grad_key, Tier.HOST)
        else:
            shard.store.put(shard.grad_key, acc, shard.grad_home)
        shard.grad_valid = True
        renote(shard)


def _pow2(x: float) -> bool:
    return x != 0.0 and math.isfinite(x) and abs(math.frexp(x)[0]) == 0.5


def _exact_later(noted: float, factor: float) -> bool:
    """Whether multiplying by ``noted * factor`` inside the step gives what multiplying by
    ``noted`` and then ``factor`` gives: one of them 1 or a power of two (exact: only the
    other rounds)."""
    return noted == 1.0 or _pow2(noted) or _pow2(factor)

