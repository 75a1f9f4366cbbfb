"""Parameter groups: a module's own parameters laid out in one flat buffer, and a rank's
slice of each group when the model is partitioned over several ranks.

A parameter shared by several modules (tied embeddings) belongs to the group of the
first module that registers it; every module that holds it needs that group too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._units import PARAM_ALIGN
from ._hf_keys import kept_in_fp32

if TYPE_CHECKING:
    from ..distributed import Partition

__all__ = ["ParamSlot", "ParamGroup", "build_groups", "slice_groups", "point", "Placeholders", "versions"]


@dataclass(eq=False)
class ParamSlot:
    """One parameter inside its group's flat buffer.

    With several ranks (offload.distributed) a rank's group holds a slice of the whole
    group's bytes: its slots keep the parameter's offset relative to the slice's start
    (negative when the parameter began on a lower rank) and say which elements the slice
    holds, ``first`` and ``count`` (all of them in a whole group).
    """

    names: list[str]
    param: nn.Parameter
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    first: int = 0  # first element of the flattened parameter held here
    count: int = -1  # elements held here; -1: all
    whole: "ParamSlot | None" = None  # in a rank's slice: the slot of the whole group

    def __post_init__(self) -> None:
        if self.count < 0:
            self.count = self.numel

    @property
    def numel(self) -> int:
        size = self.dtype.itemsize
        return self.nbytes // size if size else 0

    def elements(self, start: int, length: int) -> tuple[int, int]:
        """Byte range, in the group's buffer, of ``length`` elements from ``start``."""
        begin = self.offset + start * self.dtype.itemsize
        return begin, begin + length * self.dtype.itemsize

    @property
    def held(self) -> tuple[int, int]:
        """Byte range of the elements held in this group's buffer."""
        return self.elements(self.first, self.count)


@dataclass(eq=False)
class ParamGroup:
    key: str  # the owning module's qualified name ("" is the root)
    slots: list[ParamSlot] = field(default_factory=list)
    nbytes: int = 0
    resident: bool = False  # small enough to stay on the device
    whole: "ParamGroup | None" = None  # a rank's slice (offload.distributed): the whole group
    begin: int = 0  # the slice's first byte in the whole group

    def add(self, name: str, param: nn.Parameter, dtype: torch.dtype) -> None:
        nbytes = param.numel() * torch.empty((), dtype=dtype).element_size()
        offset = -(-self.nbytes // PARAM_ALIGN) * PARAM_ALIGN
        self.slots.append(ParamSlot([name], param, offset, nbytes, dtype, param.shape))
        self.nbytes = offset + nbytes


def build_groups(model: nn.Module, *, dtype: torch.dtype | None, resident_bytes: int,
                 group_bytes: int = 0) -> tuple[list[ParamGroup], dict[nn.Module, list[ParamGroup]]]:
    """Groups in registration order, and for each module the groups its own parameters live in.

    Consecutive modules are merged into one group while it stays within ``group_bytes``
    (0: one group per module): fewer, larger transfers, which disks serve faster.
    Registration order is, for nearly every model, the order of execution, so a merged
    group is used by modules that run one after the other.
    """
    owner: dict[int, tuple[ParamGroup, ParamSlot]] = {}
    groups: list[ParamGroup] = []
    needs: dict[nn.Module, list[ParamGroup]] = {}
    open_group: ParamGroup | None = None
    kept = kept_in_fp32(model, dtype)

    def dtype_of(name: str, param: nn.Parameter) -> torch.dtype:
        if dtype is None or not param.is_floating_point():
            return param.dtype
        return torch.float32 if kept is not None and kept(name) else dtype

    for module_name, module in model.named_modules(remove_duplicate=True):
        own = sum(p.numel() * dtype_of(f"{module_name}.{n}" if module_name else n, p).itemsize
                  for n, p in module.named_parameters(recurse=False) if id(p) not in owner)
        mergeable = (open_group is not None and own >= resident_bytes
                     and open_group.nbytes + own <= group_bytes)
        group = open_group if mergeable else ParamGroup(module_name or "<root>")
        used: list[ParamGroup] = []
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if id(param) in owner:  # tied: held by an earlier module
                other, slot = owner[id(param)]
                slot.names.append(full)
                if other not in used:
                    used.append(other)
                continue
            group.add(full, param, dtype_of(full, param))
            owner[id(param)] = (group, group.slots[-1])
        if group.slots:
            if group is not open_group:
                group.resident = group.nbytes < resident_bytes
                groups.append(group)
                if not group.resident:  # a small resident module does not end a merge
                    open_group = group
            used.insert(0, group)
        if used:
            needs[module] = used
    return groups, needs


def slice_groups(groups: list[ParamGroup], partition: "Partition") -> list[ParamGroup]:
    """Rank ``partition.rank``'s slice of each group: a group of ``slice_bytes`` whose slots
    say which elements of each parameter it holds (possibly none)."""
    out = []
    for whole in groups:
        size = partition.slice_bytes(whole.nbytes)
        begin = partition.rank * size
        end = begin + size
        part = ParamGroup(whole.key, nbytes=size, resident=False, whole=whole, begin=begin)
        for slot in whole.slots:
            itemsize = slot.dtype.itemsize
            lo = min(max(begin - slot.offset, 0), slot.nbytes)
            hi = max(min(end - slot.offset, slot.nbytes), lo)
            first = lo // itemsize if itemsize else 0
            count = (hi - lo) // itemsize if itemsize else 0
            part.slots.append(ParamSlot(slot.names, slot.param, slot.offset - begin, slot.nbytes, slot.dtype,
                                        slot.shape, first=first if count else 0, count=count, whole=slot))
        out.append(part)
    return out


def point(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data``, past the parameter class's ``__torch_function__`` (a managed
    parameter's would take it for a user's write, see ``_demand``)."""
    with torch._C.DisableTorchFunctionSubclass():
        param.data = data


class Placeholders:
    """What a released parameter's ``.data`` is: a stride-0 tensor of its shape holding NaN
    (0 for integers), so code that reads shapes outside forward works; one element per dtype."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bases: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        base = self._bases.get(dtype)
        if base is None:
            fill = float("nan") if (dtype.is_floating_point or dtype.is_complex) else 0
            base = self._bases[dtype] = torch.full((1,), fill, dtype=dtype, device=self.device)
        return base.expand(shape) if len(shape) else base.view(())

    def address(self, dtype: torch.dtype) -> int:
        """Where every placeholder of ``dtype`` points (a released parameter's data_ptr)."""
        base = self._bases.get(dtype)
        return base.data_ptr() if base is not None else self(dtype, ()).data_ptr()


def versions(group: ParamGroup) -> tuple:
    """The version counters of the group's parameters (an in-place op bumps its tensor's)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tuple(slot.param._version for slot in group.slots)
