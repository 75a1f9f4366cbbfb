"""What the activation estimate's meta run answers itself, where the meta device's own
answer would differ from the real device's run or is missing (``_activation_estimate``).

- ``scaled_dot_product_attention``: on meta it runs its math path, which saves the attention
  matrix (batch x heads x sequence squared); the fused kernels torch picks on a real device
  keep only the inputs, the output and the log-sum-exp. The call is answered as the real
  device would run it: the fused kernel where torch would pick one (on the CPU as
  ``torch._fused_sdp_choice`` says: without dropout; on CUDA always; where the
  memory-efficient kernel runs with a mask, the mask it keeps is not counted), the math path
  otherwise. Its backward hands back gradients of the inputs' shapes.
- The grouped matmul of mixture-of-experts layers, whose meta kernel takes bf16 only, is
  answered for any dtype, its inputs saved as its backward needs them.
- A true-or-false read of a tensor's value (``if mask.all():``) has no value to read on
  meta. transformers' mask code reads such values to skip building a mask for a batch
  without padding or packed sequences; each read is answered true, that batch's path, and
  counted so that the plan can say so. Any other value read (``.item()`` of a number, a
  data-dependent shape) still fails the run: its answer would set a shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RealKernels", "ValueReads"]

_GROUPED_MM = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None}


class RealKernels(TorchFunctionMode):
    """The module's first two answers, within its ``with``."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM:
            return self._grouped_mm(func, *args, **kwargs)
        if func is not F.scaled_dot_product_attention or not self._fused(*args, **kwargs):
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if any(x.requires_grad for x in (q, k, v)) and torch.is_grad_enabled():
            return _FusedAttention.apply(q, k, v)
        return _attention_output(q, v)

    def _grouped_mm(self, func, a, b, *args, out_dtype=None, **kwargs):
        with torch.no_grad():  # (the shape only, from bf16 stand-ins)
            shape = func(a.detach().to(torch.bfloat16), b.detach().to(torch.bfloat16), *args, **kwargs).shape
        dtype = out_dtype or a.dtype
        if (a.requires_grad or b.requires_grad) and torch.is_grad_enabled():
            return _GroupedMatmul.apply(a, b, shape, dtype)
        return torch.empty(shape, dtype=dtype, device="meta")

    def _fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> bool:
        if self.device_type != "cpu":
            return True
        # (stand-ins with the real ones' requires_grad: a mask that requires grad, T5's learned
        # position bias, sends the CPU to the math path, which saves the attention matrix)
        tiny = lambda t: torch.empty((1, t.shape[-3] if t.dim() > 2 else 1, 2, t.shape[-1]), dtype=t.dtype,  # noqa: E731
                                     requires_grad=t.requires_grad)
        mask = None if attn_mask is None else torch.zeros((1, 1, 2, 2), dtype=attn_mask.dtype,
                                                          requires_grad=attn_mask.requires_grad)
        try:
            return torch._fused_sdp_choice(tiny(query), tiny(key), tiny(value), mask, dropout_p, is_causal,
                                           scale=scale, enable_gqa=enable_gqa) != 0  # 0: the math path
        except (RuntimeError, TypeError):  # a torch without this choice: the math path, counted as such
            return False


def _attention_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # (laid out as the fused kernels write it, batch x sequence x heads x dim and handed out
    # transposed: the usual transpose-and-reshape after attention is then a view, not a copy)
    if q.dim() == 4:
        b, h, t = q.shape[:-1]
        return torch.empty((b, t, h, v.shape[-1]), dtype=q.dtype, device="meta").transpose(1, 2)
    return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device="meta")


class _FusedAttention(torch.autograd.Function):
    """A fused attention kernel's memory: it saves its inputs, its output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = _attention_output(q, v)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device="meta"))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, shape, dtype):
        ctx.save_for_backward(a, b)
        return torch.empty(shape, dtype=dtype, device="meta")

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None, None


class ValueReads(TorchDispatchMode):
    """The module's third answer: a meta tensor's true-or-false value read is true; ``count``
    says how many were answered. Past ``LIMIT`` reads (a loop on a value: ``while
    mask.any():``) it answers no more: the run fails as a value read on meta does."""

    LIMIT = 1000

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta"
                and args[0].dtype == torch.bool):
            self.count += 1
            if self.count > self.LIMIT:
                raise RuntimeError(f"the forward read more than {self.LIMIT} true-or-false values from tensors "
                                   "(a loop on a value): not answered on the meta device")
            return True
        return func(*args, **(kwargs or {}))
