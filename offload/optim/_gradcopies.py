"""Calls on an offloaded ``p.grad`` that its gradient book does not answer from what it
noted (``_grads``): they run on copies of the gradient's elements read from their tier,
and a call that writes them in place has its result written back. A result that views a
copy (``p.grad.view(-1)``, ``p.grad[0]``) becomes a :class:`CopyView`, which refuses
writes: they would change the copy, not the gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..params import kind_of, write_targets

__all__ = ["on_copies", "CopyView"]

_plain = torch._C.DisableTorchFunctionSubclass


def _is_grad(t: Any) -> bool:
    """An ``OffloadedGrad`` (``_grads``, which imports this module)."""
    return getattr(type(t), "offloaded_grad", False)


def on_copies(func: Any, args: tuple, kwargs: dict, grads: list) -> Any:
    """Run ``func`` on copies of the gradients' elements; write back those it wrote."""
    copies = {id(g): g._book.values(g._param).to(g.device) for g in grads}

    def swap(a: Any) -> Any:
        return copies[id(a)] if _is_grad(a) else a

    out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
    written = write_targets(kind_of(func), args, kwargs)
    for g in grads:
        if any(t is g for t in written):
            g._book.write(g._param, copies[id(g)])
    for g in grads:  # an in-place call returns its target (a call returning its input unwritten: the copy)
        if out is copies[id(g)] and any(t is g for t in written):
            return g
    return _guard_views(out, {c.untyped_storage().data_ptr() for c in copies.values()})


def _guard_views(out: Any, storages: set[int]) -> Any:
    """Results that view one of the copies (``p.grad.view(-1)``, ``p.grad[0]``) become
    :class:`CopyView`: a write through them would change the copy, not the gradient."""
    def guard(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not _is_grad(t):
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
        if any(getattr(t, "offloaded_grad", False) for t in types):  # its values first (it calls again)
            return NotImplemented
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
