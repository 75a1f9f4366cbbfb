"""What an offload optimizer is doing: one enum, changed in one checked place.

``IDLE`` between steps (gradients may be held); ``ACCUMULATING`` while a backward adds
gradients into the accumulators; ``UPDATING_IN_BACKWARD`` from entering
``update_during_backward()`` until the ``step()`` that finishes its work; ``STEPPING`` inside
``step()``; ``UPDATING_IN_FORWARD`` from a ``step()`` that left its update of a wrapped
model's shards to the next forward until the last of them is written; ``LOADING`` while a
checkpoint or state dict streams in; ``POISONED`` when a step, an update during backward or
a load stopped half way: the weights and states are a mix, so every step is refused until a
load succeeds.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["OptimizerPhase", "Phase"]


class OptimizerPhase(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    UPDATING_IN_BACKWARD = "updating in backward"
    STEPPING = "stepping"
    UPDATING_IN_FORWARD = "updating in the next forward"
    LOADING = "loading"
    POISONED = "poisoned"


_P = OptimizerPhase
# A load may start anywhere but inside a step (it is how a poisoned optimizer recovers);
# anything may fail into POISONED. An interrupted backward leaves ACCUMULATING behind: the
# next call closes it (IDLE) before it goes on.
# A step taken while a backward still adds (from a hook, as torch allows) comes back to
# ACCUMULATING.
_ALLOWED = {
    _P.IDLE: {_P.ACCUMULATING, _P.UPDATING_IN_BACKWARD, _P.STEPPING, _P.UPDATING_IN_FORWARD, _P.LOADING,
              _P.POISONED},
    _P.ACCUMULATING: {_P.IDLE, _P.STEPPING, _P.LOADING, _P.POISONED},
    _P.UPDATING_IN_BACKWARD: {_P.STEPPING, _P.IDLE, _P.LOADING, _P.POISONED},
    _P.STEPPING: {_P.IDLE, _P.ACCUMULATING, _P.UPDATING_IN_FORWARD, _P.POISONED},
    # (every other call finishes the owed update first: back to IDLE before it goes on)
    _P.UPDATING_IN_FORWARD: {_P.IDLE, _P.POISONED},
    _P.LOADING: {_P.IDLE, _P.POISONED},
    _P.POISONED: {_P.LOADING, _P.POISONED},
}


class Phase:
    """The optimizer's phase and, when poisoned, why."""

    def __init__(self) -> None:
        self.value = OptimizerPhase.IDLE
        self.reason: str | None = None
        # called with the reason when poisoned (a poison cleared by a load tells nobody: what
        # it marked stays until a load of the weights or close(), see _optimizer)
        self.on_poison: Any = None

    def enter(self, new: OptimizerPhase) -> None:
        if new is not self.value and new not in _ALLOWED[self.value]:
            raise RuntimeError(f"offload optimizer: cannot go from {self.value.value} to {new.value}"
                               + (f" ({self.reason})" if self.reason else ""))
        self.value = new
        if new is not OptimizerPhase.POISONED:
            self.reason = None

    def poison(self, reason: str, *, weights: bool = True) -> None:
        """A step or load stopped half way through ``reason``; the first reason is kept.
        ``weights``: whether it may have changed the models' weights (``on_poison`` is told)."""
        if self.value is not OptimizerPhase.POISONED:
            self.reason = reason
        self.value = OptimizerPhase.POISONED
        if self.on_poison is not None and weights:
            self.on_poison(self.reason)

    @property
    def poisoned(self) -> bool:
        return self.value is OptimizerPhase.POISONED

    def refuse_if_poisoned(self) -> None:
        if self.poisoned:
            raise RuntimeError(
                f"the previous {self.reason}: the model's weights and the optimizer states are partly from "
                "it. Load a checkpoint (offload.load_checkpoint(path, model, optimizer)) or the "
                "optimizer's and the model's state dicts to go on, or close() the optimizer")
