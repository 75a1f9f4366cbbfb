"""Demand fetch: a streamed parameter shows its real values wherever code touches it.

Between uses a streamed parameter's ``.data`` is a placeholder (stride 0, NaN) and its bytes
rest in the parameter tier. The hooks materialize a group around its own module's forward
and backward. Code that reaches a parameter any other way (a parent computing
``self.proj.weight @ x``, ``F.linear(x, other.weight)``, ``p.detach()``, ``print(p)``,
``model.state_dict()``, ``load_state_dict()``, ``nn.init``) goes through
:class:`OffloadedParameter`'s ``__torch_function__``, which fetches the group for the length
of that one call (see ``_access.DemandAccess`` for the bookkeeping).

Note: why a class swap. ``wrap`` sets the class of each managed parameter to
:class:`OffloadedParameter` (an ``nn.Parameter`` subclass of the same layout) and ``unwrap``
sets it back. The object stays the same, so optimizers, tied modules and user references
keep working, and torch routes every function, method and property of it through
``__torch_function__``. A placeholder tensor subclass would not do: a parameter's ``.data``
cannot be set to a tensor of another dispatch class.

Note: results that alias the group's buffer. A view made in such a call (``p.t()``, ``p[0]``,
``p.detach()``, ``p.data``) would show other bytes once the buffer is reused, so it is
made again on a copy of the whole parameter (``_copies.DetachedCopy``: it writes an
in-place change back, and refuses use once the parameter has changed). What autograd saves
for backward goes through the hooks' references (``ModuleHooks``), so backward fetches the
group again.

Note: threads. The coordinator's bookkeeping belongs to the thread that wrapped the model
(and to backward's threads); a use from another thread could swap a group out from under
the training thread, so it is refused.

Note: gradients. ``p.grad`` and ``p.grad = value`` go to the optimizer that holds the
parameter's gradients when torch's own field is empty (``_gradients``).

Note: writes. An in-place op on the parameter itself (``p.copy_(x)``, ``p.mul_(2)``,
``nn.init.normal_(p)``, ``p.data = x`` of the same shape, dtype and device, what
``load_state_dict`` does) runs on the fetched group, which is then marked dirty, so it is
written home when dropped; optimizers that keep a master copy are told to refresh it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from ._calls import DATA, DETACH, LAYOUT, NO_DATA, REPR, Kind, kind_of, returns_itself, write_targets
from .._autograd import in_backward
from ._copies import DetachedCopy, read_only
from ._gradients import DEFERRED, TRAINABLE, get_grad, set_grad, set_trainable
from ._groups import ParamGroup, ParamSlot
from ._replaced import replaced_slots

__all__ = ["OffloadedParameter", "Owner", "owner_of_param", "register", "unregister", "value_of", "refuse_copy"]

_plain = torch._C.DisableTorchFunctionSubclass
_GRAD_GET, _GRAD_SET = torch._C.TensorBase.grad.__get__, torch._C.TensorBase.grad.__set__


@dataclass(eq=False)
class Owner:
    """Where a managed parameter lives: its model's access object, its group and slot."""

    access: Any  # _access.DemandAccess
    group: ParamGroup
    slot: ParamSlot

    @property
    def name(self) -> str:
        return self.slot.names[0]

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0] or "<root>"


_owners: dict[int, Owner] = {}  # id(parameter) -> its owner, while wrapped
_classes: dict[type, type] = {}  # a parameter class -> its offloaded subclass


class OffloadedParameter(nn.Parameter):
    """The class of a wrapped model's parameters while it is wrapped (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if DEFERRED and not DEFERRED.isdisjoint(types):  # e.g. p.add_(p.grad): p.grad's values first
            return NotImplemented
        if func == _GRAD_GET:  # an optimizer may hold it (_gradients); (method-wrappers: ==, not is)
            return get_grad(args[0])
        if func == _GRAD_SET:
            return set_grad(args[0], args[1])
        if func in _AUTOGRAD:
            return _autograd_call(func, args, kwargs)
        if func in TRAINABLE:  # (an optimizer built over it frozen takes its gradients once it trains)
            return set_trainable(func, args, kwargs)
        if func is DETACH and sys._getframe(1).f_code is _PARAMETER_NEW:
            raise RuntimeError(
                "nn.Parameter(p) of a parameter offload manages (as parametrize does when it registers on a "
                "wrapped module): the new Parameter would share storage offload moves between tiers. Take "
                "nn.Parameter(p.detach().clone()) for a copy, or register parametrizations before offload.wrap")
        if func not in NO_DATA:
            found = _find(args, kwargs)
            if found:
                return _serve(func, args, kwargs, found)
        with _plain():
            return func(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        # pickled as a plain parameter with its real values (torch.save of a weight)
        return (torch._utils._rebuild_parameter, (value_of(self), self.requires_grad, OrderedDict()))

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(value_of(self), self.requires_grad)
        return memo[id(self)]


_CLASSES = {OffloadedParameter}
_PARAMETER_NEW = nn.Parameter.__new__.__code__


def offloaded_class(cls: type) -> type:
    """The offloaded subclass of parameter class ``cls`` (one per class, made once)."""
    if cls is nn.Parameter or cls in _CLASSES:
        return OffloadedParameter if cls is nn.Parameter else cls
    made = _classes.get(cls)
    if made is None:
        made = _classes[cls] = type(f"Offloaded{cls.__name__}", (OffloadedParameter, cls), {})
        _CLASSES.add(made)
    return made


def register(param: nn.Parameter, owner: Owner) -> None:
    """Route ``param``'s uses through demand fetch (at wrap)."""
    cls = type(param)
    try:
        param.__class__ = offloaded_class(cls)
    except TypeError as err:
        raise TypeError(f"parameter {owner.name!r} is a {cls.__name__}, whose layout offload cannot extend "
                        f"to fetch it on use ({err}): convert it to torch.nn.Parameter before wrap") from None
    _owners[id(param)] = owner


def unregister(param: nn.Parameter) -> None:
    """Give ``param`` its class back (at unwrap or close)."""
    if _owners.get(id(param)) is not None and _owners[id(param)].slot.param is param:
        del _owners[id(param)]
    cls = type(param)
    if cls in _CLASSES:
        base = next(b for b in cls.__mro__[1:] if b not in _CLASSES)
        param.__class__ = base


def owner_of_param(param: Any) -> Owner | None:
    owner = _owners.get(id(param))
    return owner if owner is not None and owner.slot.param is param else None


def any_registered() -> bool:
    return bool(_owners)


_AUTOGRAD = {torch.autograd.grad, torch.autograd.backward}


def _autograd_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``autograd.grad(loss, params)`` / ``backward(inputs=params)``: the parameters go as
    their gradient edges, so nothing is fetched for the call (all of them at once could
    pass the budget) and the backward fetches what it reads as any backward does. A
    parameter among the outputs or ``materialize_grads`` (which edges do not take) is
    served as any call: fetched for its length."""
    grad = func is torch.autograd.grad
    inputs = args[1] if grad else kwargs.get("inputs")
    rest = (args[0], kwargs.get("grad_outputs" if grad else "grad_tensors"))
    if inputs is None or kwargs.get("materialize_grads") or _find(rest, {}):
        found = _find(args, kwargs)
        if found:
            return _serve(func, args, kwargs, found)
        with _plain():
            return func(*args, **kwargs)
    with _plain():
        edges = tuple(get_gradient_edge(t) if isinstance(t, OffloadedParameter) else t for t in inputs)
    return func(args[0], edges, *args[2:], **kwargs) if grad else func(*args, **{**kwargs, "inputs": edges})


def _find(args: tuple, kwargs: dict) -> list[Owner] | None:
    """The owners of the managed parameters among the call's arguments (one level into lists)."""
    found = None
    for values in (args, kwargs.values()):
        for a in values:
            for b in a if type(a) in (list, tuple) else (a,):
                if type(b) in _CLASSES:
                    owner = _owners.get(id(b))
                    if owner is not None and owner.slot.param is b:
                        if found is None:
                            found = []
                        found.append(owner)
    return found


def _serve(func: Any, args: tuple, kwargs: dict, found: list[Owner]) -> Any:
    access = found[0].access
    if threading.get_ident() != access.thread and not in_backward():
        raise RuntimeError(
            f"offloaded parameter {found[0].name!r} used from another thread than the one that wrapped the "
            "model: its group could be fetched or released under that thread's forward and backward. Use "
            "the model on the thread that wrapped it: to stream with a TextIteratorStreamer, call generate() "
            "there and read the streamer on the other thread, or wrap the model on the thread that generates; "
            "for a copy to use elsewhere, take offload.state_dict(model) there")
    kind = kind_of(func)
    if kind is Kind.CONVERT and owner_of_param(args[0] if args else None) is not None \
            and returns_itself(func, args, kwargs):
        return args[0]
    for owner in found:  # a step whose update runs in this forward may owe the group new bytes
        if owner.access.coordinator.pending:
            owner.access.coordinator.pending.ready(owner.group, reading=kind not in (Kind.WRITE, Kind.SET_DATA))
    if func is DETACH and access.snapshots is not None:  # model.state_dict() in progress
        # (a copy even of a resident or cached group: entries that alias one group buffer
        # would share storage, which safetensors' save_model and Accelerate refuse)
        if replaced_slots(found[0].group, access.coordinator.placeholder) \
                and not access.materialized(found[0].group):  # (p.set_(): its values become the group's)
            access.coordinator.acquire(found[0].group, "demand", record=False)
            access.coordinator.release(found[0].group, "demand")
        return access.snapshot(found[0])
    written = [o for o in (owner_of_param(t) for t in write_targets(kind, args, kwargs)) if o is not None]
    missing = [o for o in _unique(found) if not o.access.materialized(o.group)]
    if not written and not missing and kind is not Kind.SET_DATA:
        if func == DATA:  # a .data alias in the module's forward: writes through it are not seen
            for owner in found:
                access.maybe_written(owner.group)
        with _plain():
            return _call(func, args, kwargs)
    if func in LAYOUT and not written:  # the real layout is the contiguous one of the slot
        with _plain():
            meta = torch.empty(found[0].slot.shape, dtype=found[0].slot.dtype, device="meta")
            return func(meta, *args[1:], **kwargs)
    for owner in missing:
        owner.access.check_readable(owner)
    first = written[0] if written else found[0]
    if kind is Kind.ADDRESS:  # (no bytes in memory, so no real address: one to compare, never to follow)
        return first.access.address_of(first)
    if kind is Kind.REFUSED:
        raise RuntimeError(
            f"{getattr(func, '__name__', func)}() on offloaded parameter {first.name!r} (module {first.module!r}) "
            "would change its shape or storage in place, which its group in offload's tiers cannot follow: "
            "call offload.unwrap(model) first, or make a new tensor instead")
    if kind is Kind.SET_DATA:
        return _set_data(found[0], args[1])
    for owner in written:
        owner.access.check_writable(owner)
    if len(_unique(written)) != 1 or len(written) != 1:
        return _run_fetched(func, args, kwargs, kind, missing, written)
    whole = func is torch.Tensor.copy_ and args[0] is written[0].slot.param and isinstance(args[1], torch.Tensor)
    written[0].access.writing = (written[0].slot, args[1] if whole else None)
    try:
        out = _run_fetched(func, args, kwargs, kind, missing, written)
    finally:
        written[0].access.writing = None
    if whole:
        written[0].access.wrote_whole(written[0].slot)
    return out


def _run_fetched(func: Any, args: tuple, kwargs: dict, kind: Kind, missing: list[Owner],
                 written: list[Owner]) -> Any:
    """Run ``func`` with the groups of ``missing`` fetched; mark those of ``written`` changed."""
    held: list[Owner] = []
    keep: set[int] = set()
    try:
        for owner in missing:
            owner.access.drop_batch_group()  # (load_state_dict: the previous group is done)
            pending = owner.access.coordinator.pending
            with pending.writes() if written and kind is Kind.WRITE else contextlib.nullcontext():
                owner.access.acquire(owner.group)
            held.append(owner)
        buffers = {o.access.buffer_address(o.group): o for o in held}
        if kind is Kind.ESCAPE:  # the result would point into the group's buffer: use a copy
            with _plain():
                args = (args[0].detach().clone(),) + tuple(args[1:])
        accessor = (written or held)[0].access
        with accessor.saving(), _plain():
            out = _call(func, args, kwargs)
        if kind is Kind.ESCAPE:
            return read_only(out)
        for owner in _unique(written):
            owner.access.written(owner.group)
            fetched = next((h for h in held if h.group is owner.group), None)
            if fetched is not None and owner.access.keep_for_batch(owner.group):
                keep.add(id(fetched))
        if not buffers or kind is Kind.WRITE:  # (an in-place op returns the parameter itself)
            return out
        return _copies_of_aliases(func, args, kwargs, out, buffers)
    finally:
        for owner in reversed(held):
            if id(owner) not in keep:
                owner.access.release(owner.group)


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    if func is REPR:  # printed like the tensor it stands for, not as a subclass
        t = args[0]
        return REPR(torch.Tensor._make_subclass(torch.Tensor, t.detach(), t.requires_grad), **kwargs)
    return func(*args, **kwargs)


def _copies_of_aliases(func: Any, args: tuple, kwargs: dict, out: Any, buffers: dict[int, Owner]) -> Any:
    """``out`` with every tensor that views a fetched group's buffer replaced by a copy.

    A view of the parameter itself (``p.detach()``, ``p.data``, ``p[0]``, ``p.T``) is made
    again on a copy of the whole parameter, so an in-place change to it can be written back
    (``DetachedCopy``); any other alias is copied on its own."""
    fetched = {id(o.group) for o in buffers.values()}

    def aliases(t: Any) -> bool:
        if type(t) in _CLASSES:  # the parameter itself (contiguous()), fetched only for this call
            owner = owner_of_param(t)
            return owner is not None and id(owner.group) in fetched
        if not isinstance(t, torch.Tensor):
            return False
        with _plain():
            return t.untyped_storage().data_ptr() in buffers

    flat = tree_flatten(out)[0]
    if not any(aliases(t) for t in flat):
        return out
    first = owner_of_param(args[0]) if args else None
    if first is not None and any(o is first or o.group is first.group for o in buffers.values()):
        with _plain():
            root = DetachedCopy.of(args[0].clone(), first)
        out = DetachedCopy.__torch_function__(func, (DetachedCopy,), (root,) + tuple(args[1:]), kwargs)

    def fix(t: Any) -> Any:
        if not aliases(t):
            return t
        with _plain():
            owner = owner_of_param(t) if type(t) in _CLASSES else buffers[t.untyped_storage().data_ptr()]
            copy = t.clone()
        return DetachedCopy.of(copy, owner)

    return tree_map(fix, out)


def _unique(owners: list[Owner]) -> list[Owner]:
    """One owner per group, in order."""
    seen: set[int] = set()
    out = []
    for owner in owners:
        if id(owner.group) not in seen:
            seen.add(id(owner.group))
            out.append(owner)
    return out


def _set_data(owner: Owner, value: Any) -> None:
    """``param.data = value``: the same shape, dtype and device are a write of the values."""
    param = owner.slot.param
    if value is param:
        return None
    with _plain():
        same = isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == param.dtype \
            and value.device == param.device
    if not same:
        what = f"a {tuple(value.shape)} {value.dtype} tensor on {value.device}" \
            if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeError(
            f"cannot set .data of offloaded parameter {owner.name!r} (module {owner.module!r}) to {what}: "
            f"it keeps the shape {tuple(owner.slot.shape)}, dtype {owner.slot.dtype} and device it was wrapped "
            "with. To change them call offload.unwrap(model) first; to run in another dtype set OffloadConfig("
            "compute_dtype=...) at wrap. (A model.to()/.half()/.double() stops here: what it reached before this one "
            "is converted already; convert those modules back one by one, e.g. model.norm.float(). Trainer's "
            "bf16_full_eval / fp16_full_eval make this call in evaluate(): leave them off, and set compute_dtype)")
    owner.access.check_writable(owner)
    with torch.no_grad():
        missing = [] if owner.access.materialized(owner.group) else [owner]
        _run_fetched(torch.Tensor.copy_, (param, value), {}, Kind.WRITE, missing, [owner])
    return None


def value_of(param: nn.Parameter) -> torch.Tensor:
    """A plain copy of a parameter's real values (any parameter: managed or not)."""
    with torch.no_grad():
        value = param.detach()
    with _plain():
        return value.as_subclass(torch.Tensor).clone() if type(value) is DetachedCopy else value.clone()


DetachedCopy.route = OffloadedParameter.__torch_function__


def refuse_copy() -> None:
    """copy.deepcopy / pickling of a wrapped model reaches the objects behind its hooks."""
    raise TypeError("copy.deepcopy or pickling of a model wrapped by offload: its parameters rest in offload's tiers "
                    "and its hooks hold files and threads. For a copy in memory, build the model again and "
                    "load_state_dict(offload.state_dict(model)), or offload.unwrap(model) first; to save it, "
                    "offload.save_checkpoint(path, model) or offload.export(model, directory). A copy of "
                    "one of its modules (copy.deepcopy(model.lm_head), as PEFT's modules_to_save makes) is "
                    "an ordinary module in memory")
