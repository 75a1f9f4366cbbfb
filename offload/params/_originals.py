"""The model's own values of trained parameters that ``compute_dtype`` narrows.

With ``compute_dtype="bf16"`` (or fp16) on an fp32 model, ``wrap`` stores each group in the
compute dtype, so the stored values are rounded. torch.amp, DeepSpeed's bf16 and Accelerate
keep the model's fp32 values as the master weights the optimizer updates; an optimizer
that built its masters from the rounded copies would start elsewhere (and, with a small
learning rate, never get back). So ``wrap`` keeps the fp32 values of parameters that
require a gradient, one fp32 tensor per group, in the slowest tier the store has (NVMe
when there is one, else host memory within the host budget), until an optimizer has taken
them as its masters; then they are dropped. A write into a group through demand fetch
(``load_state_dict``, ``p.copy_``) makes its kept values stale: they are dropped, and the
master comes from the written values, as an optimizer built after that write would see
them without offload.
"""

from __future__ import annotations

import logging

import torch

from .._units import format_size
from ..io import BudgetError
from ..store import Tier, TensorStore
from ._groups import ParamGroup, ParamSlot

__all__ = ["Originals", "narrows"]

log = logging.getLogger(__name__)


def narrows(source: torch.Tensor, slot: ParamSlot) -> bool:
    """Whether storing ``source`` as ``slot.dtype`` rounds a trained parameter."""
    return slot.param.requires_grad and source.is_floating_point() and slot.dtype.is_floating_point \
        and torch.finfo(source.dtype).bits > torch.finfo(slot.dtype).bits


class Originals:
    """The kept fp32 values, per group, until every trained slot's master is taken."""

    def __init__(self, store: TensorStore):
        self.store = store
        self.tier = Tier.NVME if Tier.NVME in store.tiers else Tier.HOST
        self._offsets: dict[int, dict[int, int]] = {}  # id(group) -> id(slot) -> first fp32 element
        self._pending: dict[int, set[int]] = {}  # id(group) -> ids of slots whose masters are not taken yet

    @staticmethod
    def key(group: ParamGroup) -> str:
        return f"{group.key}/original"

    def keep(self, group: ParamGroup, sources: dict[int, torch.Tensor]) -> None:
        """Keep ``sources`` (id(slot) -> the model's tensor) for ``group``'s narrowed slots."""
        slots = [s for s in group.slots if id(s) in sources]
        total = sum(s.numel for s in slots)
        flat = torch.empty(total, dtype=torch.float32)
        offsets, at = {}, 0
        for slot in slots:
            flat[at: at + slot.numel].copy_(sources[id(slot)].reshape(-1))
            offsets[id(slot)] = at
            at += slot.numel
        try:
            self.store.put(self.key(group), flat, self.tier)
        except BudgetError as err:
            raise BudgetError(
                f"compute_dtype rounds the parameters of group {group.key!r}, so wrap keeps their "
                f"{format_size(total * 4)} of fp32 values until an optimizer takes them as master weights, and "
                f"the {self.tier.value} tier has no room for them ({err}). Raise host_budget, give an "
                "nvme_path (they are kept there), or cast the model to the compute dtype before wrap (the "
                "masters then start from those values)") from None
        self._offsets[id(group)] = offsets
        self._pending[id(group)] = set(offsets)

    def values(self, group: ParamGroup) -> dict[int, torch.Tensor] | None:
        """id(slot) -> fp32 flat values of ``group``'s kept slots (a host copy), or None."""
        offsets = self._offsets.get(id(group))
        if offsets is None:
            return None
        flat = self.store.read_copy(self.key(group))
        return {sid: flat[at: at + next(s.numel for s in group.slots if id(s) == sid)]
                for sid, at in offsets.items()}

    def taken(self, group: ParamGroup, slot: ParamSlot) -> None:
        """An optimizer built ``slot``'s master from the kept values."""
        pending = self._pending.get(id(group))
        if pending is not None:
            pending.discard(id(slot))
            if not pending:
                self.forget(group)

    def forget(self, group: ParamGroup) -> None:
        if self._offsets.pop(id(group), None) is not None:
            self._pending.pop(id(group), None)
            self.store.delete(self.key(group))

    @property
    def kept(self) -> int:
        return len(self._offsets)
