"""The gradient calls of an offload optimizer: ``zero_grad``, clipping, loss scaling and
``p.grad`` of wrapped parameters, over the gradients its sink holds (``_grads``).

A mixin of :class:`~offload.optim._optimizer.OffloadOptimizer`, as ``_persist`` is: it uses
the facade's parts (the sink, the gradient book, the scaler, the deferral of an update owed
to the next forward) and its ``_settle``.
"""

from __future__ import annotations

import math

import torch

from ..params import hold_gradients, watch_trainable
from ._layout import ParamEntry, expected_gradients
from ._norms import scale_all, total_norm

__all__ = ["GradientCalls"]


class GradientCalls:
    def _take_gradients(self, entry: ParamEntry) -> None:
        """Take a wrapped parameter's gradients from its next backward on; a frozen one's
        once it requires grad (``watch_trainable``)."""
        if entry.hooked:
            return
        p = entry.param
        if not p.requires_grad:
            watch_trainable(p, self)
            return
        hold_gradients(p, self, entry.owner.slot.names[0])
        self._sink.hook(entry)
        for shard in {id(s.shard): s.shard for s in entry.segments if s.shard is not None}.values():
            shard.expected = expected_gradients(shard)  # (its accumulator waits for this one too)

    def became_trainable(self, param: torch.Tensor) -> None:
        entry = self._book.entries.get(id(param))
        if entry is not None and entry.owner is not None and not self._closed:
            self._take_gradients(entry)

    def _refuse_untaken_gradients(self) -> None:
        """A gradient on a wrapped parameter that bypassed the sink (set by hand on a frozen
        one, or its requires_grad turned on where offload does not see it) would be left out
        of the update, where torch's optimizer takes it: refused by name."""
        for entry in self._book.entries.values():
            if entry.owner is not None and not entry.hooked:
                with torch._C.DisableTorchFunctionSubclass():
                    stray = torch._C.TensorBase.grad.__get__(entry.param) is not None
                if stray:
                    raise RuntimeError(
                        f"parameter {entry.owner.slot.names[0]!r} of a wrapped model has a gradient that "
                        f"{type(self).__name__} did not take: it was frozen when given to the optimizer and got "
                        "its gradient another way than through requires_grad_() (p.grad set by hand, or "
                        "requires_grad changed outside Python). torch's optimizer would update it with that "
                        "gradient. Call p.requires_grad_(True) before the backward, or drop it (p.grad = None)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: with ``set_to_none=False`` the gradients held are zeros (a step
        still takes them) rather than none."""
        if set_to_none:
            self.reset_gradients()
        else:
            self._settle()
            self._sink.sync()
            self._grads.zero_kept()
            self._clipped = False
        super().zero_grad(set_to_none=set_to_none)  # (plain parameters; the wrapped ones are done)

    def reset_gradients(self) -> None:
        """Drop every gradient this optimizer holds for wrapped parameters, with its noted
        norms and factors (``zero_grad()``, a checkpoint load). While a step's update is owed
        to the next forward it still needs them: hidden now, dropped when it is done."""
        self._clipped = False
        if not self._later.hide():
            self._drop_gradients()

    def _drop_gradients(self) -> None:
        self._sink.reset()
        self._grads.cleared()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all this optimizer's parameters to a total norm of
        ``max_norm`` (like ``torch.nn.utils.clip_grad_norm_``) and return the total norm.

        Offloaded gradients are not read: their norm comes from what was noted when they
        were written, and the factor is noted with them (``p.grad`` shows it) and applied
        inside the next ``step()``.
        """
        norm_type = float(norm_type)
        self._settle()
        if self._early is not None:
            raise RuntimeError("clip_grad_norm_() after update_during_backward(): the shards were updated "
                               "during backward, before the total norm was known. To clip, run "
                               "backward(), clip_grad_norm_(), step() without update_during_backward()")
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type={norm_type}: offload optimizers clip by the 2-norm or the inf-norm")
        self._sink.sync()
        self._ensure_layout()
        self._grads.settle()  # (a factor noted on p.grad: torch's norm is of the products, and the clip multiplies them)
        total = torch.tensor(total_norm(self._book, norm_type) / self._scaler.factor)
        # (the factor in fp32 tensor arithmetic, as clip_grad_norm_ computes it: to the bit)
        scale_all(self._book, float(torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)))
        self._clipped = True
        return total

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16 dynamic loss scaling); call ``backward()`` on
        the result. Unchanged when loss scaling is off."""
        return self._scaler.scale_loss(loss)

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._settle()  # (an owed update divides by the scale its sums were made in)
        self._scaler.scale = float(value)

    def gradient_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param.grad`` of a wrapped parameter whose gradient this optimizer holds (see
        ``_grads``); None when it holds none."""
        if self._later.hidden(param):
            return None  # (a view's calls finish the owed update first: GradientBook.check)
        return self._grads.view(param)

    def set_gradient(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """``param.grad = value`` for a wrapped parameter: None drops what this optimizer
        holds for it (``model.zero_grad()``), a tensor replaces it."""
        if value is None and self._later.hide(param):
            return  # (the owed update reads it first)
        self._settle()
        self._grads.assign(param, value)
