"""The tensor ``p.grad`` is for a wrapped parameter whose gradient an offload optimizer
holds: :class:`OffloadedGrad`, whose calls its ``GradientBook`` (``_grads``, which says what
each call does) answers from the accumulators."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..params import LAYOUT, NO_DATA, defer_to
from ._gradcopies import on_copies

__all__ = ["OffloadedGrad"]

_plain = torch._C.DisableTorchFunctionSubclass
_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm}
_SCALE = {torch.Tensor.mul_: False, torch.Tensor.__imul__: False, torch.Tensor.div_: True,
          torch.Tensor.__itruediv__: True}
_UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_  # (GradScaler.unscale_)
_SELF = {torch.Tensor.detach, torch.Tensor.detach_, torch.Tensor.requires_grad_, torch._C.TensorBase.data.__get__}
_DATA_SET = torch._C.TensorBase.data.__set__


class OffloadedGrad(torch.Tensor):
    """What ``p.grad`` is for a parameter whose gradient rests in an offload optimizer."""

    offloaded_grad = True  # (how _gradcopies tells it apart without importing it)

    _book: Any  # its GradientBook (_grads)
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
        if func == _DATA_SET and args[0] is first:  # p.grad.data = t: t's values (method-wrappers: ==)
            _set_data(first, args[1])
            return None
        if func in _NORMS and len(grads) == 1 and args[0] is first:
            order = _vector_order(func, args, kwargs)
            if order is not None:
                value = first._book.norm(first._param, order)
                dtype = kwargs.get("dtype") or first.dtype
                return torch.tensor(value, dtype=dtype, device=first.device)
        if func is _UNSCALE:
            return _unscale(*args, **kwargs)
        if func is torch.Tensor.zero_ and args[0] is first:  # zeros, still a gradient (a step takes it)
            first._book.zero(first._param)
            return first
        if func in _SCALE and len(args) == 2 and args[0] is first and not kwargs:
            factor = _number(args[1])
            if factor is not None and not (factor == 0.0 and _SCALE[func]):  # (x / 0: as torch, on a copy)
                divide = _SCALE[func]
                if divide and first.device.type == "cuda" and _cpu_scalar(args[1]):
                    # (torch's CUDA kernel divides by a CPU scalar as a product with its fp32 reciprocal)
                    factor, divide = float(torch.tensor(1.0) / torch.tensor(factor, dtype=torch.float32)), False
                first._book.scale(first._param, factor, divide=divide)
                return first
        return on_copies(func, args, kwargs, grads)


def _set_data(grad: "OffloadedGrad", new: Any) -> None:
    if not isinstance(new, torch.Tensor) or new.shape != grad.shape or new.is_complex():
        raise RuntimeError(
            f"p.grad.data = {type(new).__name__} of shape {tuple(getattr(new, 'shape', ()))}: an offloaded "
            f"parameter's gradient rests in the optimizer in shape {tuple(grad.shape)}; assign values of that "
            "shape (p.grad.data = t or p.grad.copy_(t)), or p.grad = None to drop it")
    with _plain():
        values = new.detach().to(dtype=torch.float32, device="cpu")
    grad._book.write(grad._param, values)


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


def _vector_order(func: Any, args: tuple, kwargs: dict) -> float | None:
    """The order of a whole-tensor vector norm call (2 or inf), else None."""
    if kwargs.get("dim") is not None or kwargs.get("out") is not None or kwargs.get("keepdim") or len(args) > 2:
        return None
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    if order == "fro" or order is None:
        order = 2
    if isinstance(order, numbers.Number) and float(order) in (2.0, math.inf):
        return float(order)
    return None


def _cpu_scalar(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or x.device.type == "cpu"


def _number(x: Any) -> float | None:
    if isinstance(x, numbers.Number) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and type(x) is not OffloadedGrad and x.numel() == 1:
        return float(x)
    return None


defer_to(OffloadedGrad)
