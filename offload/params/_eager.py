"""What offload manages runs eagerly under ``torch.compile``.

Note: a managed module's weights move in its forward hooks (Python that fetches, points
``param.data`` at a group buffer and releases the buffer for reuse), and autograd's saved
tensors go through the model's hooks. Dynamo cannot trace that, and a compiled graph that
captured a weight's buffer would later read whatever the buffer then holds. So the hooks
and the forwards of the modules offload manages (the root's too) are excluded from
compilation with ``torch.compiler.disable``: ``torch.compile(model)`` or a layer's
``module.compile()`` runs them as uncompiled code does, to the same results, and the rest
of a compiled function still compiles.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import nn

from ._demand import refuse_copy

__all__ = ["EagerForwards"]


class _Eager:
    """``fn`` excluded from compilation; like the hooks' own object, it refuses copies and
    pickling of the wrapped model with the ways to do it (``refuse_copy``)."""

    def __init__(self, fn: Callable) -> None:
        self._run = torch.compiler.disable(fn)
        self.active = True  # False once unwrapped (a wrapper put over it may keep it in its chain)
        functools.update_wrapper(self, fn)  # (inspect.signature(model.forward) sees the forward's)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    def __deepcopy__(self, memo):
        if self.active:
            refuse_copy()
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce_ex__(self, protocol):
        if self.active:
            refuse_copy()
        return self.__wrapped__.__reduce_ex__(protocol)


class EagerForwards:
    """The forwards this model's hooks made eager, put back by :meth:`restore`."""

    def __init__(self) -> None:
        self._made: list[tuple[nn.Module, bool, Any, Any]] = []  # module, had its own forward, that, ours

    @staticmethod
    def hook(fn: Callable) -> Callable:
        return _Eager(fn)

    def make_eager(self, module: nn.Module, *, root: bool = False) -> None:
        had = "forward" in module.__dict__
        before = module.__dict__.get("forward")
        ours = _Eager(module.forward)
        module.forward = ours
        self._made.append((module, had, before, ours))
        if not root:  # (the root's copy is refused: its hooks hold files and threads)
            module.__dict__["__deepcopy__"] = functools.partial(_plain_copy, module)

    def restore(self) -> None:
        """Each forward as it was, unless something replaced ours since (Accelerate's
        wrappers set ``module.forward`` too): that one stays, and ours in its chain copies
        and pickles as the forward it wraps."""
        for module, had, before, ours in reversed(self._made):
            ours.active = False
            module.__dict__.pop("__deepcopy__", None)
            if module.__dict__.get("forward") is not ours:
                continue
            if had:
                module.forward = before
            else:
                del module.__dict__["forward"]
        self._made.clear()


def _plain_copy(module: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a module of a wrapped model below its root (PEFT's
    ``modules_to_save`` copies the modules it names): an ordinary module in memory, its
    parameters plain copies of their values (``OffloadedParameter.__deepcopy__``), without
    offload's hooks or forward; the original stays wrapped. Copying the whole model is
    refused (``refuse_copy``)."""
    cls = type(module)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state = {}
    for key, value in module.__dict__.items():
        if key == "__deepcopy__":
            continue
        if isinstance(value, _Eager):  # our forward: the module's own one, or what it wrapped
            wrapped = value.__wrapped__  # (the class's forward bound at wrap: the copy has its own)
            if getattr(wrapped, "__self__", None) is not module or \
                    getattr(wrapped, "__func__", None) is not getattr(type(module), key, None):
                state[key] = wrapped  # (a forward of its own: bound to the copy, as torch's deepcopy does)
            continue
        if key.endswith("_hooks") and isinstance(value, dict):
            value = value.__class__((k, v) for k, v in value.items() if not isinstance(v, _Eager))
        state[key] = value
    new.__dict__.update(copy.deepcopy(state, memo))
    return new
