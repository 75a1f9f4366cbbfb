"""Who holds the gradient of a wrapped parameter, so that ``p.grad`` can show it.

An offload optimizer takes each gradient of a wrapped parameter off the device as autograd
produces it (``p.grad`` is set back to None), so code written for torch that reads or
clears ``p.grad`` (``clip_grad_norm_``, ``model.zero_grad()``, per-parameter norms in a log)
would see nothing. The optimizer registers itself here as the *holder* of those gradients;
:class:`_demand.OffloadedParameter` then asks it for ``p.grad`` whenever torch's own field is
empty, and hands it ``p.grad = value``.

One holder per parameter: a second optimizer over the same parameters would never see a
gradient (the first takes them), so it is refused, naming the first.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

import torch

__all__ = ["GradientHolder", "hold_gradients", "release_gradients", "holder_of", "close_holders", "get_grad", "set_grad",
           "defer_to", "DEFERRED", "watch_trainable", "set_trainable", "TRAINABLE"]

# Tensor classes that stand for values held elsewhere (the optimizer's p.grad): a call that
# has one among its arguments is left to that class's __torch_function__ first (it swaps in
# the values, then calls again), so no other handler runs the call on its placeholder.
DEFERRED: set[type] = set()


def defer_to(cls: type) -> None:
    DEFERRED.add(cls)

log = logging.getLogger(__name__)

_plain = torch._C.DisableTorchFunctionSubclass
_T = torch._C.TensorBase


class GradientHolder(Protocol):
    closed: bool

    def gradient_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """What ``param.grad`` shows while torch's own field is empty."""

    def set_gradient(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """``param.grad = value`` while torch's own field is empty (None drops the gradient)."""

    def close(self) -> None:
        """Release its states, hooks and threads."""

    def give_up(self) -> bool:
        """Close, handing its parameters to a new holder, unless it holds a gradient (which
        the new one would not see); whether it closed."""


# id(parameter) -> weak references to (parameter, holder): neither is kept alive by this
_holders: dict[int, tuple[weakref.ref, weakref.ref]] = {}
# id(parameter) -> (parameter, optimizer) pairs, as weak references, to tell when a frozen
# parameter they hold starts to require grad (``watch_trainable``)
_watchers: dict[int, list[tuple[weakref.ref, weakref.ref]]] = {}
_watched = [1024]  # the size at which _watchers is next swept
TRAINABLE = {_T.requires_grad.__set__, torch.Tensor.requires_grad_}


def _entry(param: torch.Tensor) -> Any:
    entry = _holders.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def hold_gradients(param: torch.Tensor, holder: Any, name: str) -> None:
    """Register ``holder`` for ``param``'s gradients. An open holder before it gives the
    parameter up where it holds no gradient (a Trainer built again over the same model, an
    optimizer dropped without close(): the model's hooks keep it alive), else it is refused."""
    first = _entry(param)
    if first is not None and first is not holder and not first.closed and not first.give_up():
        raise ValueError(
            f"parameter {name!r} already belongs to an open {type(first).__name__} (id {id(first):#x}) that holds "
            "its gradient, taken as backward produced it: a second optimizer over it would never see it. Step the "
            "first optimizer, or drop the gradients (model.zero_grad()): an optimizer that holds none is closed "
            "when another takes its parameters. To train with both settings, give all the parameters to one "
            "optimizer, in several param groups")
    _holders[id(param)] = (weakref.ref(param), weakref.ref(holder))


def release_gradients(param: torch.Tensor, holder: Any) -> None:
    if _entry(param) is holder:
        del _holders[id(param)]


def close_holders(params: list[torch.Tensor], what: str, level: int = logging.WARNING) -> None:
    """Close the open optimizers holding any of ``params``, as ``what`` (offload.unwrap,
    offload.close) releases the store their states and gradients live in: left open, their
    hooks took the next backward's gradients into a store that was gone (a KeyError)."""
    holders = {id(h): h for h in map(holder_of, params) if h is not None}
    for holder in holders.values():
        log.log(level, "%s closed the %s (id %#x) over this model's parameters: its states and gradients live in "
                "the model's swap files and buffers, which it releases. To carry them on, take opt.state_dict() "
                "before and load it into a new optimizer after", what, type(holder).__name__, id(holder))
        holder.close()


def holder_of(param: torch.Tensor) -> Any:
    holder = _entry(param)
    return holder if holder is not None and not holder.closed else None


def get_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad``: torch's own field, else what its holder keeps."""
    with _plain():
        grad = _T.grad.__get__(param)
    if grad is None:
        holder = holder_of(param)
        if holder is not None:
            return holder.gradient_of(param)
    return grad


def set_grad(param: torch.Tensor, value: Any) -> None:
    """``param.grad = value``. While torch's field is empty, the holder's gradient is the one
    replaced (or dropped); while backward has just put one there (the holder's own hook
    taking it), torch's field is set as usual."""
    with _plain():
        grad = _T.grad.__get__(param)
    holder = holder_of(param)
    if grad is None and holder is not None:
        holder.set_gradient(param, value)
        return
    with _plain():
        _T.grad.__set__(param, value)


def watch_trainable(param: torch.Tensor, holder: Any) -> None:
    """Call ``holder.became_trainable(param)`` when the frozen ``param`` starts to require
    grad (``p.requires_grad_()``, ``module.requires_grad_()``, ``p.requires_grad = True``):
    an optimizer built over a frozen parameter takes its gradients from then on, as torch's
    updates any parameter that has one."""
    if len(_watchers) > 2 * _watched[0]:  # (now and then: drop the entries of parameters that are gone)
        for key in [k for k, pairs in _watchers.items() if not any(p() is not None for p, _ in pairs)]:
            del _watchers[key]
        _watched[0] = max(len(_watchers), 1024)
    live = [(p, h) for p, h in _watchers.get(id(param), []) if p() is param and h() is not None]
    _watchers[id(param)] = live + [(weakref.ref(param), weakref.ref(holder))]


def set_trainable(func: Any, args: tuple, kwargs: dict) -> Any:
    """A call of ``TRAINABLE`` on a wrapped parameter: made, then told to its watchers."""
    with _plain():
        out = func(*args, **kwargs)
        param = args[0]
        trainable = param.requires_grad
    if trainable:
        failed = None
        for ref, holder_ref in _watchers.pop(id(param), []):
            holder = holder_ref()
            if ref() is param and holder is not None and not holder.closed:
                try:  # (each is told, whatever another raises)
                    holder.became_trainable(param)
                except Exception as err:  # noqa: BLE001 - raised once every holder was told
                    failed = failed or err
        if failed is not None:
            raise failed
    return out
