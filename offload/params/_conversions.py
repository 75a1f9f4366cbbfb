"""``model.to(...)``, ``.half()``, ``.cuda()`` ... of a wrapped model: refused before anything
is converted when they would change its parameters' dtype or device.

torch's ``Module._apply`` converts the children first, then each parameter: a refusal from
one parameter's ``.data =`` (``_demand._set_data``) came after buffers and earlier modules
had changed, and where torch replaces the parameter object instead (``.to("meta")``, whose
tensor type differs; torch's ``__future__`` conversion flags) nothing refused at all: the
model stopped being offloaded, or broke at the next forward. From the first wrap on,
``Module._apply`` asks first: the conversion function is tried on an empty tensor of each
dtype and device the offloaded parameters below the module have, and a change is refused
naming the call's result. Conversions that change nothing (``model.to(its device)``,
``.float()`` of an fp32 model, ``share_memory()``) go on as before, under torch's default
conversion settings (its ``__future__`` flags that replace parameters are refused further in:
``_demand``). What the probe cannot show (a conversion that depends on a tensor's shape, as
``memory_format=torch.channels_last``) meets ``_demand._set_data``'s refusal per parameter.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch
from torch import nn

from ._demand import any_registered, owner_of_param

__all__ = ["install_conversion_guard"]

_installed = False
_inside = threading.local()  # (the outermost _apply checked the whole tree: its children's calls need not)


def install_conversion_guard() -> None:
    global _installed
    if _installed:
        return
    original = nn.Module._apply

    @functools.wraps(original)
    def _apply(self: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
        if getattr(_inside, "active", False) or not any_registered():
            return original(self, fn, *args, **kwargs)
        _refuse_changes(self, fn, recurse=kwargs.get("recurse", args[0] if args else True))
        _inside.active = True
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            _inside.active = False

    nn.Module._apply = _apply
    _installed = True


def _refuse_changes(module: nn.Module, fn: Callable, *, recurse: bool) -> None:
    kinds: dict[tuple[torch.dtype, torch.device], str] = {}
    for name, p in module.named_parameters(recurse=bool(recurse)):
        owner = owner_of_param(p)
        if owner is not None:
            kinds.setdefault((p.dtype, p.device), owner.name)
    for (dtype, device), name in kinds.items():
        try:
            probe = fn(torch.empty(0, dtype=dtype, device=device))
        except Exception:  # noqa: BLE001 - a function only real tensors suit: its own call decides
            continue
        if not isinstance(probe, torch.Tensor) or (probe.dtype, probe.device) == (dtype, device):
            continue
        dtype_fix = "" if probe.dtype == dtype else (
            "; to run in another dtype set OffloadConfig(compute_dtype=...) at wrap (Trainer's bf16_full_eval / "
            "fp16_full_eval make this call in evaluate(): leave them off)")
        raise RuntimeError(
            f"this conversion of {type(module).__name__} would make the parameters of a model wrapped by offload "
            f"(e.g. {name!r}) {probe.dtype} on {probe.device}; they keep the {dtype} on {device} they were wrapped "
            f"with, and nothing was converted. To change them call offload.unwrap(model) first{dtype_fix}")
