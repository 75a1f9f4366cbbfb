"""What a model holds, by name, wherever its bytes rest: the parameters (with their tied
aliases) and persistent buffers, and for a wrapped model the parameter group holding each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..params._manager import ParamManager, _managers

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
    manager: ParamManager | None
    params: list[Tensorish] = field(default_factory=list)
    buffers: list[Tensorish] = field(default_factory=list)
    by_id: dict[int, Tensorish] = field(default_factory=dict)

    def all(self) -> list[Tensorish]:
        return self.params + self.buffers

    def param_name(self, p: torch.Tensor) -> str | None:
        t = self.by_id.get(id(p))
        return t.name if t is not None else None


def catalog(model: nn.Module) -> Catalog:
    manager = _managers.get(model)
    cat = Catalog(model, manager)
    if manager is not None:
        for group in manager.groups:
            for slot in group.slots:
                t = Tensorish(slot.names[0], list(slot.names[1:]), "param", slot.dtype, tuple(slot.shape),
                              slot.param, group, slot)
                cat.params.append(t)
                cat.by_id[id(slot.param)] = t
    else:
        for name, p in model.named_parameters(remove_duplicate=False):
            t = cat.by_id.get(id(p))
            if t is not None:
                t.aliases.append(name)
                continue
            t = Tensorish(name, [], "param", p.dtype, tuple(p.shape), p)
            cat.params.append(t)
            cat.by_id[id(p)] = t
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
