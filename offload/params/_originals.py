"""The model's own values of trained parameters that ``compute_dtype`` narrows.

With ``compute_dtype="bf16"`` (or fp16) on an fp32 model, ``wrap`` stores each group in the
compute dtype, so the stored values are rounded. torch.amp, DeepSpeed's bf16 and Accelerate
keep the model's fp32 values as the master weights the optimizer updates; an optimizer
that built its masters from the rounded copies would start elsewhere (and, with a small
learning rate, never get back). So ``wrap`` keeps the fp32 values of parameters that
require a gradient, one fp32 tensor per parameter, in the NVMe tier, until an optimizer
has taken them as its masters; then they are dropped. Without an NVMe tier nothing is kept
(host memory is the model's own budget) and a warning says the masters will start from
the rounded values. Inference needs none of it: parameters that do not require a gradient
are not kept. A write of a whole parameter through demand
fetch (``model.load_state_dict``, ``p.copy_(x)``) replaces its kept values with the
written ones when they are wider (an fp32 state dict into a bf16 run), and drops them
otherwise; any other write into a group (in place, a checkpoint load) drops the group's
(``checkpoint`` keeps a load's wider values itself).
"""

from __future__ import annotations

import logging

import torch

from ..store import Tier, TensorStore
from ._groups import ParamGroup, ParamSlot

__all__ = ["Originals", "narrows"]

log = logging.getLogger(__name__)


def narrows(source: torch.Tensor, slot: ParamSlot) -> bool:
    """Whether storing ``source`` as ``slot.dtype`` rounds a trained parameter."""
    return slot.param.requires_grad and source.is_floating_point() and slot.dtype.is_floating_point \
        and torch.finfo(source.dtype).bits > torch.finfo(slot.dtype).bits


class Originals:
    """The kept fp32 values, one stored tensor per slot, until an optimizer takes them."""

    def __init__(self, store: TensorStore):
        self.store = store
        self.tier = Tier.NVME if Tier.NVME in store.tiers else None
        self._kept: dict[int, dict[int, str]] = {}  # id(group) -> id(slot) -> store key
        self._warned = False

    def keep(self, group: ParamGroup, sources: dict[int, torch.Tensor]) -> None:
        """Keep ``sources`` (id(slot) -> the model's tensor) for ``group``'s narrowed slots."""
        for index, slot in enumerate(group.slots):
            if id(slot) in sources:
                self._put(group, index, slot, sources[id(slot)])

    def replace(self, group: ParamGroup, slot: ParamSlot, source: torch.Tensor | None) -> None:
        """``slot`` was written: keep ``source`` for it when it is wider than the slot, else
        forget what was kept for it (the written values are the masters' start)."""
        self._drop(group, slot)
        if source is not None and narrows(source, slot):
            self._put(group, group.slots.index(slot), slot, source)

    def values(self, group: ParamGroup) -> dict[int, torch.Tensor] | None:
        """id(slot) -> fp32 flat values of ``group``'s kept slots (host copies), or None."""
        kept = self._kept.get(id(group))
        if not kept:
            return None
        return {sid: self.store.read_copy(key) for sid, key in kept.items()}

    def taken(self, group: ParamGroup, slot: ParamSlot) -> None:
        """An optimizer built ``slot``'s master from the kept values."""
        self._drop(group, slot)

    def forget(self, group: ParamGroup) -> None:
        for key in self._kept.pop(id(group), {}).values():
            self.store.delete(key)

    @property
    def kept(self) -> int:
        return sum(len(k) for k in self._kept.values())

    def _put(self, group: ParamGroup, index: int, slot: ParamSlot, source: torch.Tensor) -> None:
        if self.tier is None:  # only NVMe: in host memory they would crowd out the model itself
            if not self._warned:
                self._warned = True
                log.warning(
                    "offload: compute_dtype rounds the trained parameters (first: %r), and without an NVMe tier "
                    "their %s values are not kept: an optimizer will start its fp32 master weights from the "
                    "rounded values. To start from the model's own values, give an nvme_path (they are kept "
                    "there until the optimizer takes them); for inference, model.requires_grad_(False) before "
                    "wrap says none is needed", slot.names[0], source.dtype)
            return
        key = f"{group.key}/original/{index}"
        flat = source.detach().reshape(-1).to("cpu", torch.float32, copy=True)
        self.store.put(key, flat, self.tier)
        self._kept.setdefault(id(group), {})[id(slot)] = key

    def _drop(self, group: ParamGroup, slot: ParamSlot) -> None:
        kept = self._kept.get(id(group))
        key = kept.pop(id(slot), None) if kept else None
        if key is not None:
            self.store.delete(key)
        if kept is not None and not kept:
            del self._kept[id(group)]
