"""``p.grad`` of a wrapped parameter whose gradient an offload optimizer holds.

The optimizer adds each gradient of a wrapped parameter into its fp32 accumulators as
autograd produces it and sets ``p.grad`` back to None (``_optimizer``'s docstring). Code
written for torch reads ``p.grad`` anyway: ``torch.nn.utils.clip_grad_norm_`` (what
Accelerate's and HF Trainer's clipping call), per-parameter norms in a log,
``model.zero_grad()``. ``params`` asks the optimizer for such a ``p.grad`` (see
``params._gradients``), and it answers with an :class:`OffloadedGrad`: a tensor of the
gradient's shape, dtype and device whose elements rest in the accumulators.

- Its 2-norm and inf-norm are the ones noted when the accumulator was written: no pass
  over the tier (``clip_grad_norm_`` reads nothing).
- Scaling it in place by a number (``g.mul_(c)``, ``g.div_(c)``: how torch clips; and
  ``torch.amp.GradScaler``'s unscale, whose overflow check reads the noted maxima) is noted
  per segment and applied inside the next ``step()``; ``g.zero_()`` and ``p.grad = None``
  drop it; ``p.grad = t`` replaces it.
- Any other call runs on a copy of its elements (read from the tier); a call that writes
  them in place has its result written back; a result that views the copy refuses writes
  (:class:`CopyView`), which would be lost.

It refuses use once ``step()`` or ``zero_grad()`` has consumed the gradient it stood for,
while a backward is still adding into it, within ``update_during_backward()`` (the update
already ran), and with several ranks (each holds a slice: use ``opt.clip_grad_norm_``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..params import LAYOUT, NO_DATA, Kind, kind_of, write_targets
from ..store import Tier

__all__ = ["OffloadedGrad", "GradientBook"]

_plain = torch._C.DisableTorchFunctionSubclass
_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm}
_SCALE = {torch.Tensor.mul_: False, torch.Tensor.__imul__: False, torch.Tensor.div_: True,
          torch.Tensor.__itruediv__: True}
_UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_  # (GradScaler.unscale_)
_SELF = {torch.Tensor.detach, torch.Tensor.detach_, torch.Tensor.requires_grad_, torch._C.TensorBase.data.__get__}


class OffloadedGrad(torch.Tensor):
    """What ``p.grad`` is for a parameter whose gradient rests in an offload optimizer."""

    _book: "GradientBook"
    _param: torch.Tensor
    _epoch: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        grads = [a for a in tree_flatten((args, kwargs))[0] if type(a) is OffloadedGrad]
        first = grads[0]
        if func in NO_DATA:
            with _plain():
                return func(*args, **kwargs)
        if func in LAYOUT:  # the gradient it stands for is contiguous
            with _plain():
                return func(torch.empty(first.shape, dtype=first.dtype, device="meta"), *args[1:], **kwargs)
        for g in grads:
            g._book.check(g)
        if func in _SELF and args and args[0] is first:
            return first
        if func in _NORMS and len(grads) == 1 and args[0] is first:
            order = _vector_order(func, args, kwargs)
            if order is not None:
                value = first._book.norm(first._param, order)
                dtype = kwargs.get("dtype") or first.dtype
                return torch.tensor(value, dtype=dtype, device=first.device)
        if func is _UNSCALE:
            return _unscale(*args, **kwargs)
        if func is torch.Tensor.zero_ and args[0] is first:
            first._book.drop(first._param)
            return first
        if func in _SCALE and len(args) == 2 and args[0] is first and not kwargs:
            factor = _number(args[1])
            if factor is not None:
                first._book.scale(first._param, 1.0 / factor if _SCALE[func] else factor)
                return first
        return _on_copies(func, args, kwargs, grads)


def _unscale(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch.amp.GradScaler's unscale: the factor noted, found_inf from the noted maxima."""
    plain = [g for g in grads if type(g) is not OffloadedGrad]
    if plain:
        with _plain():
            _UNSCALE(plain, found_inf, inv_scale)
    factor = float(inv_scale)
    for g in grads:
        if type(g) is OffloadedGrad:
            if not g._book.finite(g._param):
                found_inf.fill_(1.0)
            g._book.scale(g._param, factor)


def _on_copies(func: Any, args: tuple, kwargs: dict, grads: list[OffloadedGrad]) -> Any:
    """Run ``func`` on copies of the gradients' elements; write back those it wrote."""
    copies = {id(g): g._book.values(g._param).to(g.device) for g in grads}

    def swap(a: Any) -> Any:
        return copies[id(a)] if type(a) is OffloadedGrad else a

    out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
    written = write_targets(kind_of(func), args, kwargs)
    for g in grads:
        if any(t is g for t in written):
            g._book.write(g._param, copies[id(g)])
    if any(out is copies[id(g)] for g in grads):  # an in-place call returns its target
        return next(g for g in grads if out is copies[id(g)])
    return _guard_views(out, {c.untyped_storage().data_ptr() for c in copies.values()})


def _guard_views(out: Any, storages: set[int]) -> Any:
    """Results that view one of the copies (``p.grad.view(-1)``, ``p.grad[0]``) become
    :class:`CopyView`: a write through them would change the copy, not the gradient."""
    def guard(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and type(t) is not OffloadedGrad:
            with _plain():
                if t.untyped_storage().data_ptr() in storages:
                    return t.as_subclass(CopyView)
        return t

    return tree_map(guard, out)


class CopyView(torch.Tensor):
    """A view of a copy of an offloaded ``p.grad``: read freely; an in-place write raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(type(t) is CopyView for t in write_targets(kind_of(func), args, kwargs)):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)}() writes into a view of an offloaded parameter's p.grad, "
                "which is a copy of the gradient resting in the optimizer: the write would be lost. Write to "
                "p.grad itself (p.grad.mul_(c), p.grad.clamp_(...), p.grad = new), or clone() the view")
        with _plain():
            storages = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                        if type(t) is CopyView}
            out = func(*args, **kwargs)
        return _guard_views(out, storages)


def _vector_order(func: Any, args: tuple, kwargs: dict) -> float | None:
    """The order of a whole-tensor vector norm call (2 or inf), else None."""
    if kwargs.get("dim") is not None or kwargs.get("out") is not None or len(args) > 2:
        return None
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    if order == "fro" or order is None:
        order = 2
    if isinstance(order, numbers.Number) and float(order) in (2.0, math.inf):
        return float(order)
    return None


def _number(x: Any) -> float | None:
    if isinstance(x, numbers.Number) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and type(x) is not OffloadedGrad and x.numel() == 1:
        return float(x)
    return None


class GradientBook:
    """The optimizer's side of ``p.grad`` (module docstring): views, norms, scales, reads
    and writes of the gradients in its accumulators."""

    def __init__(self, optimizer: Any):
        self.opt = optimizer
        self.epoch = 0  # advanced when step() or zero_grad() consumes the gradients
        self._views: dict[int, OffloadedGrad] = {}

    def consumed(self) -> None:
        self.epoch += 1
        self._views.clear()
        for shard in self.opt._shards:
            for seg in shard.segments:
                seg.scale, seg.sumsq, seg.maxabs = 1.0, 0.0, 0.0

    def view(self, param: torch.Tensor) -> OffloadedGrad | None:
        segs = self.opt._segments_of.get(id(param))
        if not segs or not any(seg.has_grad for seg in segs):
            return None
        view = self._views.get(id(param))
        if view is None:
            with _plain():
                base = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
            view = torch.Tensor._make_subclass(OffloadedGrad, base, False)
            view._book, view._param, view._epoch = self, param, self.epoch
            self._views[id(param)] = view
        return view

    def check(self, view: OffloadedGrad) -> None:
        opt = self.opt
        if view._epoch != self.epoch or opt._closed:
            raise RuntimeError("this p.grad stood for a gradient that step() or zero_grad() has consumed (or the "
                               "optimizer is closed): read p.grad again after the next backward")
        self.check_param(view._param)

    def check_param(self, param: torch.Tensor) -> None:
        opt = self.opt
        if opt._early:
            raise RuntimeError("p.grad within update_during_backward(): the update ran during backward, before "
                               "this call could change the gradient. Run backward() and step() outside it")
        if opt._partition() is not None:
            raise RuntimeError("p.grad of an offloaded parameter with several ranks: each rank holds a slice of "
                               "the gradient, so norms and clipping over p.grad would be per rank. Use "
                               "opt.clip_grad_norm_(max_norm), which reduces over the ranks")
        opt._sync_drains()
        if any(seg.shard.acc is not None for seg in opt._segments_of[id(param)]):
            raise RuntimeError("p.grad read while a backward is still adding into it: read it after backward")

    # -- what a view's calls do --------------------------------------------------------
    def norm(self, param: torch.Tensor, order: float) -> float:
        segs = [seg for seg in self.opt._segments_of[id(param)] if seg.has_grad]
        scale = self.opt.loss_scale if self.opt._scaler_enabled else 1.0
        if order == 2.0:
            return math.sqrt(sum(seg.sumsq * seg.scale ** 2 for seg in segs)) / scale
        return max((seg.maxabs * abs(seg.scale) for seg in segs), default=0.0) / scale

    def finite(self, param: torch.Tensor) -> bool:
        return all(math.isfinite(seg.maxabs) for seg in self.opt._segments_of[id(param)] if seg.has_grad)

    def scale(self, param: torch.Tensor, factor: float) -> None:
        for seg in self.opt._segments_of[id(param)]:
            seg.scale *= factor

    def values(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of the gradient's elements, in the parameter's shape and dtype (on the CPU)."""
        flat = torch.zeros(param.numel(), dtype=torch.float32)
        scale = self.opt.loss_scale if self.opt._scaler_enabled else 1.0
        for seg in self.opt._segments_of[id(param)]:
            if seg.has_grad:
                acc = _read(seg.shard)
                flat[seg.start: seg.start + seg.length] = acc[seg.offset: seg.offset + seg.length] * (seg.scale / scale)
        return flat.to(param.dtype).view(param.shape)

    def write(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Make ``value`` the gradient (``p.grad = value`` or an in-place call's result)."""
        with _plain():
            if tuple(value.shape) != tuple(param.shape):
                raise RuntimeError(f"assigned grad has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")
            flat = value.detach().reshape(-1).float().cpu()
        scale = self.opt.loss_scale if self.opt._scaler_enabled else 1.0
        for seg in self.opt._segments_of[id(param)]:
            part = flat[seg.start: seg.start + seg.length] * scale  # held as backward left it: scaled
            self._rewrite(seg, part)
            seg.has_grad = True

    def drop(self, param: torch.Tensor) -> None:
        for seg in self.opt._segments_of[id(param)]:
            if seg.has_grad:
                seg.has_grad = False
                if any(s.has_grad for s in seg.shard.segments):  # the rest of the shard keeps its sums
                    self._rewrite(seg, torch.zeros(seg.length))
                else:
                    seg.shard.grad_valid = False
                seg.scale, seg.sumsq, seg.maxabs = 1.0, 0.0, 0.0
            _renote(seg.shard)
        self._views.pop(id(param), None)

    def _rewrite(self, seg: Any, part: torch.Tensor) -> None:
        shard = seg.shard
        acc = _read(shard)  # the resting tensor in host memory, else a copy put back below
        if not shard.grad_valid:  # its stale sums are zeroed by the next backward; so here
            acc.zero_()
            for other in shard.segments:
                other.has_grad, other.scale, other.sumsq, other.maxabs = False, 1.0, 0.0, 0.0
        acc[seg.offset: seg.offset + seg.length] = part
        seg.scale = 1.0
        seg.sumsq = float(torch.dot(part, part))
        seg.maxabs = float(part.abs().max()) if part.numel() else 0.0
        if shard.grad_home is Tier.HOST:
            shard.store.mark_dirty(shard.grad_key, Tier.HOST)
        else:
            shard.store.put(shard.grad_key, acc, shard.grad_home)
        shard.grad_valid = True
        _renote(shard)


def _read(shard: Any) -> torch.Tensor:
    """The shard's gradient accumulator: the resting tensor in host memory, else a copy."""
    if shard.grad_home is Tier.HOST:
        return shard.store.wait(shard.grad_key, Tier.HOST)
    return shard.store.read_copy(shard.grad_key)


def _renote(shard: Any) -> None:
    """The shard's noted norm and finiteness from its segments'."""
    held = [seg for seg in shard.segments if seg.has_grad]
    shard.sumsq = sum(seg.sumsq for seg in held)
    shard.maxabs = max((seg.maxabs for seg in held), default=0.0)
    shard.finite = math.isfinite(shard.maxabs)
