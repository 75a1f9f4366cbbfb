"""Loss scaling for fp16 training: the scale, when it grows and halves, and whether a step's
backward went through it. On by default for fp16 parameters (``loss_scale="auto"``)."""

from __future__ import annotations

import logging
from typing import Any, Callable

__all__ = ["LossScaler"]

log = logging.getLogger(__name__)

_INITIAL = 2.0 ** 16
_GROWTH_INTERVAL = 2000


class LossScaler:
    """``loss_scale``: ``"dynamic"``, a fixed number, or None (off).

    ``on_change(old, new)`` is told when a dynamic scale changes: the held gradient sums are
    in its units, so their books follow (``_grads.GradientBook.loss_scale_changed``)."""

    def __init__(self, loss_scale: str | float | None, on_change: Callable[[float, float], None]):
        self.dynamic = loss_scale == "dynamic"
        self.enabled = loss_scale is not None
        self.scale = _INITIAL if self.dynamic else float(loss_scale or 1.0)
        self.good_steps = 0
        self.skips_in_a_row = 0
        self.growth_interval = _GROWTH_INTERVAL
        self.scaled = False  # scale_loss() called since the last step
        self._on_change = on_change

    @property
    def factor(self) -> float:
        """What the step divides the gradients by."""
        return self.scale if self.enabled else 1.0

    def scale_loss(self, loss: Any) -> Any:
        self.scaled = True
        return loss * self.scale if self.enabled else loss

    def check_scaled(self) -> None:
        """A step with loss scaling on divides the gradients by the scale: refuse one whose
        backward did not multiply by it (a loop that never calls scale_loss())."""
        if self.enabled and not self.scaled:
            raise RuntimeError(
                f"this optimizer scales the loss (loss_scale={'dynamic' if self.dynamic else self.scale}; on "
                "by default for fp16 parameters) and divides the gradients by {:g} in step(), but this step's "
                "backward did not go through opt.scale_loss(loss): the update would be {:g}x too small. Call "
                "opt.scale_loss(loss).backward(); or, when another scaler scales the loss (HF Trainer's "
                "fp16=True, Accelerate's mixed_precision='fp16', torch.amp.GradScaler), build the optimizer "
                "with loss_scale=None".format(self.scale, self.scale))

    def skipped(self) -> None:
        """An overflow skipped the step: a dynamic scale halves."""
        if self.dynamic:
            if self.scale / 2 == 0.0:  # (GradScaler's would reach 0 and skip every step after, silently)
                raise FloatingPointError(
                    f"the loss scale underflowed to 0 after {self.skips_in_a_row + 1} steps in a row whose gradients "
                    "overflowed: the loss or the gradients are inf or NaN whatever the scale. Check the data and "
                    "the model's outputs (a loss of inf, a division by zero)")
            self._set(self.scale / 2)  # (no floor: torch.amp.GradScaler halves on, below 1 too)
            self.good_steps = 0
        self.skips_in_a_row += 1
        log.info("gradients overflowed: step skipped, loss scale now %g", self.scale)

    def stepped(self) -> None:
        """A step went through: a dynamic scale doubles after ``growth_interval`` of them."""
        self.skips_in_a_row = 0
        if not self.dynamic:
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self._set(self.scale * 2)
            self.good_steps = 0

    def _set(self, new: float) -> None:
        self._on_change(self.scale, new)
        self.scale = new

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "dynamic": self.dynamic, "loss_scale": self.scale,
                "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved scale when both this scaler and the saved one are on, unless this one
        is fixed (a scale the user set stays what they set)."""
        if self.enabled and state.get("enabled") and self.dynamic:
            self.scale = float(state["loss_scale"])
            self.good_steps = int(state["good_steps"])
