"""``init_empty_weights``: a model built with its parameters on the meta device, for
``wrap(..., checkpoint=)`` to fill."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["init_empty_weights"]


# In-place ops and initializers that only set values: on a meta tensor they do nothing but
# cost the Python reference kernels' time (GPT-2 1.5B's initializers: 0.75 s of a 1 s
# build). Known by name: transformers swaps torch.nn.init's functions for its own.
_VALUES_ONLY = frozenset((
    "normal_", "uniform_", "fill_", "zero_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_",
    "clamp_min_", "clamp_max_", "erfinv_", "exponential_", "random_", "bernoulli_", "log_normal_",
    "cauchy_", "geometric_", "masked_fill_", "fmod_", "abs_", "neg_", "sqrt_", "exp_", "log_",
    "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"))


class _SkipMetaValues(torch.overrides.TorchFunctionMode):
    """Skips value-only in-place ops on meta tensors (initializers of parameters that the
    checkpoint will fill): the shapes and dtypes they leave are the ones they found. What
    such an op would raise on a meta tensor (a shape mismatch) is not raised."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _VALUES_ONLY:
            # (torch.nn.init passes its tensor by keyword)
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build a model with parameters on the meta device and buffers real.

    Buffers computed at construction (rotary frequencies, attention masks) are often not
    saved in checkpoints, so they must not be lost to the meta device. Initializers and
    in-place ops that only set a meta tensor's values are skipped: there are no values to
    set. Every op in the block passes through that check, so build the model here and wrap
    it outside.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        with _SkipMetaValues():
            yield
    finally:
        nn.Module.register_parameter = original
