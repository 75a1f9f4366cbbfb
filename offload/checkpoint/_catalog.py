"""What a model holds, by name, wherever its bytes rest: the parameters (with their tied
aliases) and persistent buffers, and for a parameter of a wrapped model the group holding it.

The model may be wrapped itself or contain wrapped modules (a PeftModel around a wrapped
base, a wrapped model inside the user's own module): names are always the given module's
own, so parameters added after ``wrap`` (LoRA adapters) and modules moved since (PEFT's
``base_layer``) are named as that module names them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..params import ParamManager, owner_of

__all__ = ["Tensorish", "Catalog", "catalog"]


@dataclass(eq=False)
class Tensorish:
    """One parameter or persistent buffer."""

    name: str  # canonical name: the first under which the model registers it
    aliases: list[str]
    kind: str  # "param" | "buffer"
    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: torch.Tensor  # the live parameter (a placeholder when offloaded) or buffer
    group: Any = None  # ParamGroup of a wrapped parameter
    slot: Any = None  # its ParamSlot
    manager: Any = None  # the ParamManager of its wrapped model

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Catalog:
    model: nn.Module
    managers: list[ParamManager] = field(default_factory=list)  # the wrapped models inside, in order
    params: list[Tensorish] = field(default_factory=list)
    buffers: list[Tensorish] = field(default_factory=list)
    by_id: dict[int, Tensorish] = field(default_factory=dict)

    @property
    def manager(self) -> ParamManager | None:
        """The first wrapped model's manager (its pool, engine settings and config serve the
        streaming); None when nothing is wrapped."""
        return self.managers[0] if self.managers else None

    def all(self) -> list[Tensorish]:
        return self.params + self.buffers

    def groups(self) -> list[tuple[ParamManager, Any]]:
        """(manager, group) of every wrapped group holding a parameter of the model."""
        held = {id(t.group) for t in self.params if t.group is not None}
        return [(m, g) for m in self.managers for g in m.groups if id(g) in held]

    def param_name(self, p: torch.Tensor) -> str | None:
        t = self.by_id.get(id(p))
        return t.name if t is not None else None


def catalog(model: nn.Module, *, reading: bool = True) -> Catalog:
    """``model``'s parameters and buffers as a checkpoint names them (``reading``: their
    values are to be read, not replaced by a load)."""
    cat = Catalog(model)
    for name, p in model.named_parameters(remove_duplicate=False):
        t = cat.by_id.get(id(p))
        if t is not None:
            t.aliases.append(name)
            continue
        found = owner_of(p)
        if found is None:
            t = Tensorish(name, [], "param", p.dtype, tuple(p.shape), p)
        else:
            manager, group, slot = found
            t = Tensorish(name, [], "param", slot.dtype, tuple(slot.shape), p, group, slot, manager)
            if manager not in cat.managers:
                cat.managers.append(manager)
        cat.params.append(t)
        cat.by_id[id(p)] = t
    if len(cat.managers) > 1 and any(m.partition is not None for m in cat.managers):
        raise ValueError("the module holds several wrapped models partitioned over ranks: save or load each "
                         "wrapped model on its own")
    for manager in cat.managers:  # a step's update still owed to the weights lands first
        manager.pending.settle(reading=reading)
    seen: dict[int, Tensorish] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            if id(buf) in seen:
                if full not in seen[id(buf)].names:
                    seen[id(buf)].aliases.append(full)
                continue
            t = Tensorish(full, [], "buffer", buf.dtype, tuple(buf.shape), buf)
            seen[id(buf)] = t
            cat.buffers.append(t)
    return cat


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 CPU tensor (a view when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
