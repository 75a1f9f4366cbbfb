"""Tensors that outlive the call that made them are made outside inference mode.

A pool's buffer, a device slot or a mapping's tensor may first be made while the user runs
a forward under ``torch.inference_mode()`` (the first evaluation, or an optimizer update
owed to the next forward); torch then marks it an inference tensor, and every later
in-place write to it outside inference mode (the next training step's reads, a state dict)
is refused. Made inside :func:`lasting`, such a tensor is an ordinary one. ``wrap()`` and
``unwrap()`` and the offload optimizers' construction run within it (:func:`made_lasting`):
called under inference mode, they make the parameters and states a later training step uses.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, TypeVar

import torch

__all__ = ["lasting", "made_lasting"]

_F = TypeVar("_F", bound=Callable)


def lasting() -> contextlib.AbstractContextManager:
    """A context in which new tensors are ordinary ones, even within inference mode (where
    leaving it would turn grad mode on: it stays off). In it, tensors made in inference
    mode cannot be written."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def made_lasting(fn: _F) -> _F:
    """``fn`` run within :func:`lasting` (``wrap()`` called under inference mode makes the
    tensors a later training step uses)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with lasting():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
