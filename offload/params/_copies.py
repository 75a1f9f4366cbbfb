"""Copies of managed parameters handed out where a view would alias a group's buffer.

Outside its module's forward a parameter's bytes are lent only for one call, so a view made
in that call (``p.detach()``, ``p.data``, ``p[0]``, ``p.T``, a ``state_dict()`` entry) is a
copy instead: a :class:`DetachedCopy`. It reads like the tensor it stands for, keeps the
autograd graph to the parameter, writes an in-place change to itself (or to a view of it)
back to the parameter, and refuses to be used once the parameter has changed since it was
taken (an optimizer step, a load), where a view would have followed the change: a stale
copy would compute quietly with old values. NumPy arrays made from it are read-only (a write
into one could not be written back).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ._calls import NO_DATA, Kind, kind_of, write_targets

__all__ = ["DetachedCopy", "read_only"]

_plain = torch._C.DisableTorchFunctionSubclass


class DetachedCopy(torch.Tensor):
    """A copy of (part of) a managed parameter (module docstring)."""

    # set by _demand: the managed parameters' __torch_function__, which serves a call that
    # also takes a managed parameter (torch calls the first overload among the arguments')
    route: Callable | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in NO_DATA:
            with _plain():
                return func(*args, **kwargs)
        copies = {}
        for values in (args, kwargs.values()):
            for a in values:
                if type(a) is cls:
                    a.check_fresh()
                    with _plain():
                        copies[a.untyped_storage().data_ptr()] = a
        out = DetachedCopy.route(func, types, args, kwargs)
        kind = kind_of(func)
        for target in write_targets(kind, args, kwargs):
            if type(target) is cls:
                target.write_back()
        if kind is Kind.ESCAPE:
            return read_only(out)

        def keep(t: Any) -> Any:  # views of a copy stay copies of the same parameter
            if not isinstance(t, torch.Tensor) or type(t) is cls:
                return t
            with _plain():
                source = copies.get(t.untyped_storage().data_ptr())
            return DetachedCopy.of(t, None, source) if source is not None else t

        return tree_map(keep, out) if copies else out

    @staticmethod
    def of(copy: torch.Tensor, owner: Any, source: DetachedCopy | None = None) -> DetachedCopy:
        """``copy`` as a DetachedCopy of ``owner``'s parameter (an ``_demand.Owner``), or as
        a view of the DetachedCopy ``source``."""
        with _plain():
            out = copy.as_subclass(DetachedCopy)
        out.offload_owner = owner if source is None else source.offload_owner
        out.offload_root = out if source is None else source.offload_root
        if source is None:
            out.offload_version = _version(owner)
        return out

    def check_fresh(self) -> None:
        owner, root = self.offload_owner, self.offload_root
        if owner is None or not owner.access.owns(owner.slot.param):
            return  # the model was unwrapped since: the copy is all there is
        if _version(owner) != root.offload_version:
            raise RuntimeError(
                f"a copy of offloaded parameter {owner.name!r} (module {owner.module!r}) taken before the "
                "parameter changed (an optimizer step, a load) is used after it: outside its module's forward, "
                "p.detach(), p.data, its views and state_dict() entries are copies, which do not follow later "
                "changes as views would. Take it again after the change, or .clone() it when the old values "
                "are what you want")

    def write_back(self) -> None:
        owner, root = self.offload_owner, self.offload_root
        if owner is None or not owner.access.owns(owner.slot.param):
            return
        with _plain():
            value = root.as_subclass(torch.Tensor).detach()
            if value.shape != owner.slot.shape:
                raise RuntimeError(
                    f"in-place write to a copy of part of offloaded parameter {owner.name!r} (module "
                    f"{owner.module!r}): outside its module's forward, views of it are copies and this one "
                    "cannot be written back. Write the parameter itself under torch.no_grad() "
                    "(p[...] = value, p.copy_(...)) or use model.load_state_dict(...)")
        with torch.no_grad():
            owner.slot.param.copy_(value)
        root.offload_version = _version(owner)  # the change is its own

    def __reduce_ex__(self, protocol):
        self.check_fresh()
        with _plain():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None):
        self.check_fresh()
        with _plain():
            return repr(self.as_subclass(torch.Tensor))

    def __deepcopy__(self, memo):
        self.check_fresh()
        with _plain():
            plain = self.as_subclass(torch.Tensor)
            # torch's deepcopy files its result under id(plain) in the memo; freed at return,
            # that id goes to the next entry's plain view, which then got this entry's copy
            # (a state dict's deepcopy gave one layer's weights under another's name). Kept
            # alive as long as the memo, as copy.deepcopy keeps what it copies.
            memo.setdefault(id(memo), []).append(plain)
            return plain.__deepcopy__(memo)


def _version(owner: Any) -> int:
    coordinator = owner.access.coordinator
    if coordinator.pending:  # a step's update owed to the group changes it: it lands first
        coordinator.pending.ready(owner.group)
    return coordinator.written_version(owner.group)


def read_only(out: Any) -> Any:
    """A NumPy array from a copy cannot pass a write on to the parameter: make it read-only."""
    flags = getattr(out, "flags", None)
    if flags is not None and hasattr(flags, "writeable"):
        flags.writeable = False
    return out
