"""The optimizer a checkpoint saves or loads, found inside the wrappers users hand over.

Training frameworks wrap the optimizer they are given: Accelerate's ``prepare`` returns an
``AcceleratedOptimizer``, Lightning a ``LightningOptimizer``, and user code its own
classes. The state lives in the innermost optimizer; a wrapper's own ``state`` may be empty
(an offload optimizer keeps its states in its tier, so ``opt.state`` is always empty), and
saving it would save nothing. So the checkpoint looks through wrappers to the optimizer
that holds the state, and refuses one it cannot reach rather than save nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..optim import OffloadOptimizer
from ..params import gradient_holder
from ._format import CheckpointError

__all__ = ["innermost_optimizer"]

log = logging.getLogger(__name__)

_DEPTH = 4  # wrappers within wrappers looked through


def innermost_optimizer(optimizer: Any, what: str) -> Any:
    """The optimizer inside ``optimizer`` that holds the state (``optimizer`` itself when
    it is one); ``what`` names the caller for the log and errors."""
    if optimizer is None or isinstance(optimizer, OffloadOptimizer):
        return optimizer
    found = _inner(optimizer, _DEPTH, set())
    if found is not None and found is not optimizer:
        log.info("%s: the state is that of the %s inside the %s it was given", what, type(found).__name__,
                 type(optimizer).__name__)
        optimizer = found
    if isinstance(optimizer, OffloadOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"{what}: the optimizer is a {type(optimizer).__name__}, neither a torch optimizer nor a wrapper of one "
            "found through its attributes, so its state cannot be reached: pass the optimizer itself")
    for group in optimizer.param_groups:
        for p in group["params"]:
            holder = gradient_holder(p)
            if holder is not None and holder is not optimizer:
                raise CheckpointError(
                    f"{what}: the {type(optimizer).__name__} given does not hold the state of its parameters, the "
                    f"open {type(holder).__name__} that takes their gradients does: pass that one")
    return optimizer


def _inner(obj: Any, depth: int, seen: set) -> Any:
    """The innermost optimizer reachable from ``obj`` through attributes, preferring an
    offload optimizer; None when there is none."""
    if id(obj) in seen or depth < 0:
        return None
    seen.add(id(obj))
    if isinstance(obj, OffloadOptimizer):
        return obj
    found = None
    for value in getattr(obj, "__dict__", {}).values():
        if isinstance(value, (torch.optim.Optimizer, OffloadOptimizer)) or _looks_wrapped(value):
            inner = _inner(value, depth - 1, seen)
            if isinstance(inner, OffloadOptimizer):
                return inner
            found = found or inner
    if found is None and isinstance(obj, torch.optim.Optimizer):
        return obj
    return found


def _looks_wrapped(value: Any) -> bool:
    """An object that wraps an optimizer (it exposes param_groups and step)."""
    return hasattr(value, "param_groups") and callable(getattr(value, "step", None)) and \
        not isinstance(value, (type, torch.nn.Module))
