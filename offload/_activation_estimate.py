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

Note: a training step. Where something trains, the forward's loss (or its first output that
requires grad) is taken back through the backward on meta too, each parameter's gradient
dropped as it is made (offload takes it into its accumulators), and the most bytes of
storages alive at once over the forward and the backward is the step's peak: the saved
tensors, the gradients of the activations and, under gradient checkpointing, a segment's
recomputed activations (which the forward alone never shows: its saved tensors are the
segments' inputs only). A backward that does not run on meta leaves the estimate of the
forward's saved tensors with the largest one's gradient beside them.

Calls whose meta path differs from the real device's, or reads a value meta has not, are
answered by ``_meta_kernels``.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ._meta_kernels import RealKernels, ValueReads

__all__ = ["ActivationEstimate", "estimate_activations"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationEstimate:
    saved_bytes: int  # distinct storages autograd keeps from forward until backward
    largest_bytes: int  # the largest of them (backward holds its gradient beside it)
    error: str | None = None  # why there is no estimate
    forward_bytes: int | None = None  # nothing trains: the most bytes a forward without grad holds at once
    step_bytes: int | None = None  # a training step's peak over its forward and backward (None: not run)
    values_assumed: int = 0  # true-or-false reads of tensor values answered true (``_meta_kernels``)
    batch_bytes: int = 0  # the batch's own tensors, alive through the step as its other tensors are

    @property
    def inference(self) -> bool:
        return self.forward_bytes is not None

    @property
    def peak_bytes(self) -> int:
        """The most bytes torch's tensors take at once: the forward's own peak for
        inference, the step's where its backward ran on meta (the module's note), else the
        saved tensors at the turn from forward to backward with the gradient of the
        largest one being computed beside them (and the output's)."""
        if self.forward_bytes is not None:
            return self.batch_bytes + self.forward_bytes
        if self.step_bytes is not None:
            return self.batch_bytes + self.step_bytes
        return self.batch_bytes + self.saved_bytes + 2 * self.largest_bytes


def estimate_activations(model: nn.Module, inputs: Mapping[str, Any], dtype: torch.dtype | None = None,
                         device_type: str = "cpu") -> ActivationEstimate:
    """Run ``model(**inputs)`` on the meta device as a training step and count what autograd
    saves and the step's peak; where nothing trains, as a forward without grad and count
    its peak (the module's notes). ``inputs``: the forward's keyword arguments (tensors of
    the batch's shape, on any device, or anything else passed as is). ``dtype``: the compute
    dtype the parameters run in (None: their own). ``device_type``: where the run computes
    ("cpu", "cuda"), which decides the attention kernel (``_meta_kernels``)."""
    if not isinstance(inputs, Mapping):
        raise TypeError(f"batch must be a mapping of the forward's keyword arguments (e.g. {{'input_ids': ids, "
                        f"'labels': ids}}), got {type(inputs).__name__}")

    made: dict[int, torch.Tensor] = {}  # (one tensor given under two names, ids as labels, stays one)

    def meta(t: Any) -> Any:  # (an input that requires grad, as training through inputs has, keeps it)
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad and t.is_leaf)
        return made[id(t)]

    params = {}
    for name, p in model.named_parameters():
        cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
        params[name] = torch.empty(p.shape, dtype=cast, device="meta", requires_grad=p.requires_grad)
    buffers = {name: meta(b) for name, b in model.named_buffers()}
    # parameters and their views (a tied head's transpose) are the tiers' bytes, counted
    # elsewhere; views of one storage count once
    weights = {t.untyped_storage()._cdata for t in (*params.values(), *buffers.values())
               if isinstance(t, torch.Tensor)}
    kwargs = tree_map(meta, dict(inputs))
    trains = any(t.requires_grad for t in (*params.values(), *tree_flatten(dict(inputs))[0])
                 if isinstance(t, torch.Tensor))
    given = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_flatten(kwargs)[0]
             if isinstance(t, torch.Tensor)}
    live, saved, reads = _LiveBytes(weights | set(given)), _Saved(weights), ValueReads()
    step = _Step(model, saved, device_type) if trains else model
    prefix = "model." if trains else ""
    if trains:
        for p in params.values():
            if p.requires_grad:  # (offload takes each gradient as it is made: the module's note)
                p.register_post_accumulate_grad_hook(_drop_grad)
    was_training = model.training
    model.train(trains)
    try:
        with torch.set_grad_enabled(trains), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
                RealKernels(device_type), live, reads:
            torch.func.functional_call(step, {prefix + k: v for k, v in {**params, **buffers}.items()}, args=(),
                                       kwargs=kwargs, strict=False, tie_weights=True)
    except Exception as err:  # noqa: BLE001 - said: not counted, or the batch refused
        if not isinstance(err, RuntimeError) and not reads.count:  # (ValueError, TypeError, KeyError: the batch's)
            raise _refused(err) from err
        # the forward reads values (.item(), data-dependent shapes), or went where a value
        # answered true sent it (a check that raises): no estimate, said
        log.info("offload: no activation estimate: the forward does not run on the meta device (%s)", err)
        return ActivationEstimate(0, 0, f"{type(err).__name__}: {err}")
    finally:
        model.train(was_training)
    batch = sum(given.values())  # (a batch of images is no small part of the step)
    if not trains:
        return ActivationEstimate(0, 0, forward_bytes=live.peak, values_assumed=reads.count, batch_bytes=batch)
    ran = step.backward_error is None
    if not ran:
        log.info("offload: the activation estimate counts the forward only: its backward does not run on the meta "
                 "device (%s)", step.backward_error)
    return ActivationEstimate(saved.at_forward, saved.largest_at_forward, step_bytes=live.peak if ran else None,
                              values_assumed=reads.count, batch_bytes=batch)


def _refused(err: Exception) -> ValueError:
    return ValueError(f"model(**batch) refused the batch given to offload.plan ({type(err).__name__}: {err}): give "
                      "the keyword arguments of one training forward, e.g. batch={'input_ids': ids, 'labels': ids}")


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


class _Saved:
    """What autograd saves, each storage counted once (not ``weights``), as of the end of the
    forward: a reentrant checkpoint's recompute in backward saves through the same hook."""

    def __init__(self, weights: set[int]):
        self.weights, self.seen = weights, set()
        self.total = self.largest = self.at_forward = self.largest_at_forward = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.weights and key not in self.seen:
            self.seen.add(key)
            self.total += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
            # (a storage freed hands its address, the key, to later ones: forgotten when freed)
            weakref.finalize(storage, self.seen.discard, key)
        return t

    def forward_done(self) -> None:
        self.at_forward, self.largest_at_forward = self.total, self.largest


class _Step(nn.Module):
    """``model(**kwargs)`` and then the backward of what it returns, in one call, so that the
    meta parameters ``functional_call`` swaps in serve a checkpointed segment's recompute in
    backward too. A backward that fails is kept in ``backward_error``.

    The autograd engine runs the backward without torch function modes, so the recompute
    would run attention on meta's math path (and checkpoint would refuse its tensors as
    other than the forward's): while the backward runs, the outermost module called enters
    ``RealKernels`` of its own for its call."""

    def __init__(self, model: nn.Module, saved: _Saved, device_type: str):
        super().__init__()
        self.model, self.saved, self.device_type, self.backward_error = model, saved, device_type, None
        self._kernels: tuple[nn.Module, RealKernels] | None = None

    def forward(self, **kwargs: Any) -> None:
        out = self.model(**kwargs)
        self.saved.forward_done()
        loss = _differentiable(out)
        if loss is None:
            self.backward_error = "no output requires grad"
            return
        handles = [h for m in self.model.modules() for h in (
            m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._exit, always_call=True))]
        try:
            loss.backward(None if loss.dim() == 0 else torch.empty_like(loss))
        except Exception as err:  # noqa: BLE001 - the batch passed the forward: the forward's estimate stands
            self.backward_error = f"{type(err).__name__}: {err}"
        finally:
            for h in handles:
                h.remove()
            # (a BaseException in a recompute skips the always_call hook: its mode was on the
            # engine's own stack, which the engine has dropped; popping here would take another)
            self._kernels = None

    def _enter(self, module: nn.Module, *_: Any) -> None:
        if self._kernels is None:
            self._kernels = (module, RealKernels(self.device_type))
            self._kernels[1].__enter__()

    def _exit(self, module: nn.Module, *_: Any) -> None:
        if self._kernels is not None and self._kernels[0] is module:
            kernels, self._kernels = self._kernels[1], None
            kernels.__exit__(None, None, None)


def _differentiable(out: Any) -> torch.Tensor | None:
    """The loss a training step takes back: ``out.loss`` where the model computes one
    (transformers' outputs with labels), else its first output that requires grad."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    values = list(out.values()) if isinstance(out, Mapping) else out
    return next((t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)


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
