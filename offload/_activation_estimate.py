"""What a training step's forward leaves for backward: the bytes of the tensors autograd
saves, estimated by running the model's forward on the meta device (no memory, no compute)
with parameters and inputs of the real shapes and dtypes.

Note: inference. Where nothing trains (no parameter or input requires grad) autograd saves
nothing, and what the batch costs is what the forward holds at once: the activations of the
layer running, and the outputs (the logits) at the end. The same meta forward, without grad
and in eval mode (dropout off, as when generating), counts that: every storage an op creates
is alive from then until its last tensor is freed, as on the real device (torch keeps a
storage's Python object while anything holds the storage, so a finalizer on it sees it go).
On the CPU it agreed with torch.profiler's peak for a real forward to within a few bytes.

Works for any model whose forward runs on meta tensors (most transformers models do);
where it does not (data-dependent shapes, ``.item()``), the estimate is unavailable and the
plan says so instead of guessing.

Note: attention. On the meta device ``scaled_dot_product_attention`` runs its math path,
which saves the attention matrix (batch x heads x sequence squared); the fused kernels torch
picks on a real device keep only the inputs, the output and the log-sum-exp. So the call is
answered here as the real device would run it: the fused kernel's saved tensors where torch
would pick one (on the CPU as ``torch._fused_sdp_choice`` says: without dropout), the math
path otherwise. On CUDA (which this machine may not have to ask) it is counted as fused;
where the memory-efficient kernel runs with a mask, the mask it keeps is not counted.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ActivationEstimate", "estimate_activations"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationEstimate:
    saved_bytes: int  # distinct storages autograd keeps from forward until backward
    largest_bytes: int  # the largest of them (backward holds its gradient beside it)
    error: str | None = None  # why there is no estimate
    forward_bytes: int | None = None  # nothing trains: the most bytes a forward without grad holds at once

    @property
    def inference(self) -> bool:
        return self.forward_bytes is not None

    @property
    def peak_bytes(self) -> int:
        """Saved tensors at the turn from forward to backward, with the gradient of the
        largest one being computed beside them (and the output's); for inference, the
        forward's own peak."""
        if self.forward_bytes is not None:
            return self.forward_bytes
        return self.saved_bytes + 2 * self.largest_bytes


def estimate_activations(model: nn.Module, inputs: Mapping[str, Any], dtype: torch.dtype | None = None,
                         device_type: str = "cpu") -> ActivationEstimate:
    """Run ``model(**inputs)`` on the meta device as a training forward and count what
    autograd saves; where nothing trains, as a forward without grad and count its peak
    (the module's note). ``inputs``: the forward's keyword arguments (tensors of the batch's
    shape, on any device, or anything else passed as is). ``dtype``: the compute dtype the
    parameters run in (None: their own). ``device_type``: where the run computes ("cpu",
    "cuda"), which decides the attention kernel (see the module's note)."""
    if not isinstance(inputs, Mapping):
        raise TypeError(f"batch must be a mapping of the forward's keyword arguments (e.g. {{'input_ids': ids, "
                        f"'labels': ids}}), got {type(inputs).__name__}")

    def meta(t: Any) -> Any:
        return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

    params = {}
    for name, p in model.named_parameters():
        cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
        params[name] = torch.empty(p.shape, dtype=cast, device="meta", requires_grad=p.requires_grad)
    buffers = {name: meta(b) for name, b in model.named_buffers()}
    storages: dict[int, int] = {}
    # parameters and their views (a tied head's transpose) are the tiers' bytes, counted
    # elsewhere; views of one storage count once
    weights = {t.untyped_storage()._cdata for t in (*params.values(), *buffers.values())
               if isinstance(t, torch.Tensor)}

    alive: list[Any] = []  # every storage counted, kept until the count is done: one freed early
    # (a branch the fused attention below cuts off the graph) would give its address, the key
    # here, to a later one

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in weights and storage._cdata not in storages:
            storages[storage._cdata] = storage.nbytes()
            alive.append(storage)
        return t

    kwargs = tree_map(meta, dict(inputs))
    trains = any(t.requires_grad for t in (*params.values(), *tree_flatten(dict(inputs))[0])
                 if isinstance(t, torch.Tensor))
    given = {t.untyped_storage()._cdata for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor)}
    live = None if trains else _LiveBytes(weights | given)  # (nothing trains: the module's note)
    was_training = model.training
    model.train(trains)
    try:
        with torch.set_grad_enabled(trains), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                _RealKernels(pack, device_type), live or contextlib.nullcontext():
            torch.func.functional_call(model, {**params, **buffers}, args=(), kwargs=kwargs,
                                       strict=False, tie_weights=True)
    except RuntimeError as err:  # the forward reads values (.item(), data-dependent shapes): no estimate, said
        log.info("offload: no activation estimate: the forward does not run on the meta device (%s)", err)
        return ActivationEstimate(0, 0, f"{type(err).__name__}: {err}")
    except Exception as err:  # (ValueError, TypeError, KeyError: what the batch gave the forward)
        raise ValueError(f"model(**batch) refused the batch given to offload.plan ({type(err).__name__}: {err}): "
                         "give the keyword arguments of one training forward, e.g. "
                         "batch={'input_ids': ids, 'labels': ids}") from err
    finally:
        model.train(was_training)
    if live is not None:
        return ActivationEstimate(0, 0, forward_bytes=live.peak)
    return ActivationEstimate(sum(storages.values()), max(storages.values(), default=0))


class _LiveBytes(TorchDispatchMode):
    """The most bytes of storages alive at once among those the ops create (not ``known``:
    the parameters', buffers' and inputs'); see the module's note on inference."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.live, self.now, self.peak = known, set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage._cdata not in self.known and storage._cdata not in self.live:
                self.live.add(storage._cdata)
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.live.discard(key)
        self.now -= nbytes


_GROUPED_MM = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None}


class _RealKernels(TorchFunctionMode):
    """Calls whose meta path differs from the real device's: ``scaled_dot_product_attention``
    saves what the real device's kernel saves (the module's note), and the grouped matmul of
    mixture-of-experts layers, whose meta kernel takes bf16 only, is answered for any dtype
    (its inputs saved, as its backward needs them)."""

    def __init__(self, pack: Any, device_type: str):
        super().__init__()
        self.pack, self.device_type = pack, device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM:
            return self._grouped_mm(func, *args, **kwargs)
        if func is not F.scaled_dot_product_attention or not self._fused(*args, **kwargs):
            return func(*args, **kwargs)
        q, k, v = args[:3]
        # (laid out as the fused kernels write it, batch x sequence x heads x dim and handed out
        # transposed: the usual transpose-and-reshape after attention is then a view, not a copy)
        if q.dim() == 4:
            b, h, t = q.shape[:-1]
            out = torch.empty((b, t, h, v.shape[-1]), dtype=q.dtype, device="meta").transpose(1, 2)
        else:
            out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device="meta")
        out.requires_grad_(any(x.requires_grad for x in (q, k, v)))
        if out.requires_grad:
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device="meta")
            for t in (q, k, v, out, lse):
                self.pack(t)
        return out

    def _grouped_mm(self, func, a, b, *args, out_dtype=None, **kwargs):
        with torch.no_grad():  # (the shape only, from bf16 stand-ins)
            shape = func(a.detach().to(torch.bfloat16), b.detach().to(torch.bfloat16), *args, **kwargs).shape
        out = torch.empty(shape, dtype=out_dtype or a.dtype, device="meta")
        if a.requires_grad or b.requires_grad:
            out.requires_grad_(True)
            self.pack(a)
            self.pack(b)
        return out

    def _fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> bool:
        if self.device_type != "cpu":
            return True
        tiny = lambda t: torch.empty((1, t.shape[-3] if t.dim() > 2 else 1, 2, t.shape[-1]), dtype=t.dtype)  # noqa: E731
        mask = None if attn_mask is None else torch.zeros((1, 1, 2, 2), dtype=attn_mask.dtype)
        try:
            return torch._fused_sdp_choice(tiny(query), tiny(key), tiny(value), mask, dropout_p, is_causal,
                                           scale=scale, enable_gqa=enable_gqa) != 0  # 0: the math path
        except (RuntimeError, TypeError):  # a torch without this choice: the math path, counted as such
            return False
