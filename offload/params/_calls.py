"""What a torch call does to a tensor among its arguments, judged from the function alone
(cached per function): reads only metadata, reads the elements, writes them in place,
replaces ``.data``, converts, hands out the memory, or changes the tensor's metadata in
place. Demand fetch (``_demand``) decides from this whether a call needs a parameter's
real bytes and whether it changes them.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = ["Kind", "kind_of", "returns_itself", "write_targets", "NO_DATA", "LAYOUT", "SET_DATA", "DATA", "REPR",
           "DETACH"]

_plain = torch._C.DisableTorchFunctionSubclass
_T = torch._C.TensorBase


class Kind(enum.Enum):
    META = "reads no element"  # shape, dtype, grad, hash ...
    READ = "reads elements"
    WRITE = "writes elements in place"
    SET_DATA = "replaces .data"
    CONVERT = "a conversion that may return the tensor itself"
    ESCAPE = "hands out memory outside torch's view tracking"
    ADDRESS = "returns the address of the elements"
    REFUSED = "changes the parameter's metadata in place"


NO_DATA = {getattr(_T, name).__get__ for name in (
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda",
    "is_meta", "is_sparse", "is_quantized", "itemsize", "nbytes", "_version", "name", "output_nr", "is_cpu",
    "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "is_nested", "_base")}
NO_DATA |= {_T.grad.__set__, _T.requires_grad.__set__, _T._backward_hooks.__set__}
NO_DATA |= {getattr(torch.Tensor, name) for name in (
    "size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "is_signed", "get_device",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "__hash__",
    "__len__", "nelement", "ndimension", "is_pinned", "is_shared", "_is_view")}
NO_DATA |= {torch._has_compatible_shallow_copy_type}
# new tensors shaped like the argument, whose values are not read (a placeholder is
# overlapping, so they come out contiguous, as of the real parameter)
NO_DATA |= {getattr(torch, name) for name in ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                                                "randn_like", "randint_like")}
NO_DATA |= {getattr(torch.Tensor, name) for name in ("new_empty", "new_zeros", "new_ones", "new_full")}
# layout questions: answered for the parameter's real (contiguous) layout, without a fetch
LAYOUT = {torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.storage_offset}
SET_DATA = _T.data.__set__
DATA = _T.data.__get__
REPR = torch.Tensor.__repr__
DETACH = _T.detach
_INPLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                   "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                   "__imatmul__"}
_REFUSED = {"set_", "resize_", "resize_as_", "detach_", "share_memory_", "as_strided_", "t_", "transpose_",
            "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_"}
# (contiguous() is an ordinary read: it returns the tensor itself, whose bytes a fetch for
# this call only lends; an extension kernel handed it would see the placeholder)
_CONVERT = {"to", "cpu", "cuda", "float", "half", "bfloat16", "double"}
_ESCAPE = {"numpy", "__array__", "__dlpack__", "untyped_storage", "storage", "_typed_storage"}
_ADDRESS = {"data_ptr"}
_kinds: dict[Any, Kind] = {}


def kind_of(func: Any) -> Kind:
    kind = _kinds.get(func)
    if kind is None:
        kind = _kinds[func] = _classify(func)
    return kind


def _classify(func: Any) -> Kind:
    if func in NO_DATA:
        return Kind.META
    if func == SET_DATA:
        return Kind.SET_DATA
    name = getattr(func, "__name__", "")
    if name in _REFUSED:
        return Kind.REFUSED
    if name in _CONVERT:
        return Kind.CONVERT
    if name in _ESCAPE:
        return Kind.ESCAPE
    if name in _ADDRESS:
        return Kind.ADDRESS
    if name in _INPLACE_DUNDER or (name.endswith("_") and not name.startswith("__")):
        return Kind.WRITE
    return Kind.READ


def returns_itself(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a conversion (``to``, ``float``, ``cpu`` ...) of a managed parameter returns
    the parameter itself: same device and dtype. ``model.to(device)`` and ``model.float()``
    then fetch nothing."""
    p = args[0]
    with _plain():
        dtype, device = p.dtype, p.device
    name = func.__name__
    wanted = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    if name in wanted:
        return wanted[name] == dtype and "memory_format" not in kwargs
    if name == "cpu":
        return device.type == "cpu" and "memory_format" not in kwargs
    if name == "cuda":
        if device.type != "cuda":
            return False
        index = kwargs.get("device", args[1] if len(args) > 1 else None)
        target = torch.device("cuda", torch.cuda.current_device()) if index is None else torch.device(
            index if not isinstance(index, int) else f"cuda:{index}")
        return target.index in (None, device.index) and "memory_format" not in kwargs
    if kwargs.get("copy") or any(a is True for a in args[3:]):  # (non_blocking=True reads as copy: fetched)
        return False
    try:
        to_device, to_dtype, _, memory_format = torch._C._nn._parse_to(
            *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
    except (TypeError, RuntimeError):
        return False
    same_device = to_device is None or (to_device.type == device.type and to_device.index in (None, device.index))
    return same_device and to_dtype in (None, dtype) and memory_format in (None, torch.preserve_format)


def write_targets(kind: Kind, args: tuple, kwargs: dict) -> list:
    """The tensors an in-place call writes: its first argument (a list for
    ``torch._foreach_*_``; ``nn.init`` passes it by keyword), that of an ``inplace=True``
    functional, and its ``out=``."""
    targets: list = []
    if kind is Kind.WRITE or kwargs.get("inplace") is True:
        first = args[0] if args else next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
        targets += list(first) if type(first) in (list, tuple) else [first]
    out = kwargs.get("out")
    if out is not None:
        targets += list(out) if type(out) in (list, tuple) else [out]
    return targets
