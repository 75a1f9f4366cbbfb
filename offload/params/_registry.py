"""The wrapped models and their managers. A model is found from itself or from a module that
holds it: a PEFT model built after ``wrap``, an Accelerate or DDP wrapper, torch.compile's
module. So ``offload.stats``, ``note_step``, ``close`` and the rest take what the user holds."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from ._groups import ParamGroup, ParamSlot
    from ._manager import ParamManager

__all__ = ["register", "forget", "within", "find", "wrapped_in", "manager_of", "owner_of", "holders_of"]

_managers: "weakref.WeakKeyDictionary[nn.Module, ParamManager]" = weakref.WeakKeyDictionary()


def register(model: nn.Module, manager: ParamManager) -> None:
    _managers[model] = manager


def forget(model: nn.Module) -> None:
    _managers.pop(model, None)


def within(model: nn.Module) -> list[tuple[nn.Module, ParamManager]]:
    """Every wrapped module that is ``model`` or lies inside it, with its manager."""
    manager = _managers.get(model)
    if manager is not None:
        return [(model, manager)]
    return [(m, _managers[m]) for m in model.modules() if m in _managers]


def find(model: nn.Module) -> tuple[nn.Module, ParamManager] | None:
    """The wrapped module that is ``model`` or the one inside it, with its manager; None if
    there is none. Several wrapped modules inside ``model`` are refused: which one is meant
    cannot be told."""
    found = within(model)
    if len(found) > 1:
        names = ", ".join(type(m).__name__ for m, _ in found)
        raise ValueError(f"this {type(model).__name__} holds {len(found)} wrapped models ({names}): pass the "
                         "wrapped one you mean")
    return found[0] if found else None


def wrapped_in(model: nn.Module) -> tuple[nn.Module, ParamManager]:
    """``find``, refusing a model that is not wrapped and holds no wrapped model."""
    found = find(model)
    if found is None:
        raise ValueError(f"this {type(model).__name__} is not wrapped and holds no wrapped model: call "
                         "offload.wrap(model, config) first")
    return found


def manager_of(model: nn.Module) -> ParamManager:
    return wrapped_in(model)[1]


def owner_of(param: torch.Tensor) -> tuple[ParamManager, ParamGroup, ParamSlot] | None:
    """The wrapped model, parameter group and slot holding ``param``; None if not wrapped."""
    for manager in _managers.values():
        found = manager.slots.get(id(param))
        if found is not None and found[1].param is param:
            return (manager, *found)
    return None


def holders_of(params: Iterable[torch.Tensor]) -> set:
    """The managers of the wrapped models whose modules hold any of ``params`` without
    managing them (adapters added after ``wrap``)."""
    ids = {id(p) for p in params}
    if not ids:
        return set()
    return {manager for model, manager in list(_managers.items())
            if any(id(p) in ids for p in model.parameters())}
