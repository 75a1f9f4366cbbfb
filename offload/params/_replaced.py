"""Parameters whose storage code replaced behind the hooks: ``p.set_(t)`` (which torch does
not pass through ``__torch_function__``), as ``torch.nn.utils.parametrize`` does when it
registers on a wrapped module or assigns a parametrized weight. Between uses a managed
parameter points at its placeholder; one found pointing elsewhere when its group is next
materialized was given new values, and they become the group's (a write, kept and written
home), as torch's parameter would hold them. Another shape or dtype is refused."""

from __future__ import annotations

import torch

from ._groups import ParamGroup, ParamSlot, Placeholders, point

__all__ = ["replaced_slots", "adopt_replaced", "settle_replaced_before_write"]

_plain = torch._C.DisableTorchFunctionSubclass


def replaced_slots(group: ParamGroup, placeholder: Placeholders) -> list[tuple[ParamSlot, torch.Tensor]]:
    """The slots of the released ``group`` whose parameter no longer points at its
    placeholder, with what it points at."""
    found = []
    with _plain():
        for slot in group.slots:
            if slot.nbytes and slot.param.data_ptr() != placeholder.address(slot.dtype):
                found.append((slot, torch.Tensor.detach(slot.param)))
    return found


def adopt_replaced(group: ParamGroup, flat: torch.Tensor, replaced: list[tuple[ParamSlot, torch.Tensor]]) -> None:
    """Copy what the parameters were set to into ``group``'s materialized bytes ``flat``."""
    with _plain(), torch.no_grad():
        for slot, new in replaced:
            if new.shape != slot.shape or new.dtype != slot.dtype:
                raise RuntimeError(
                    f"parameter {slot.names[0]!r} was set to a {tuple(new.shape)} {new.dtype} tensor (p.set_(), "
                    f"as torch.nn.utils.parametrize does) after offload.wrap; its group keeps the shape "
                    f"{tuple(slot.shape)} and dtype {slot.dtype} it was wrapped with. Register parametrizations "
                    "before wrap, or offload.unwrap(model) first")
            flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(new)


def settle_replaced_before_write(group: ParamGroup, placeholder: Placeholders, replaced: str) -> None:
    """``group``'s stored bytes are about to be replaced. ``replaced`` says what becomes of a
    parameter set to other storage since its last use: "refuse" (an optimizer update, which
    starts from the values offload holds, would lose its new values or the update), "discard"
    (a load: the loaded values win, as torch's load_state_dict overwrites them) or "keep"."""
    if replaced == "keep":
        return
    found = replaced_slots(group, placeholder)
    if found and replaced == "refuse":
        raise RuntimeError(
            f"parameter {found[0][0].names[0]!r} was set to other storage (p.set_(), as torch.nn.utils."
            "parametrize does) between its last use and this optimizer update, which starts from the values "
            "offload holds. Run a forward (or read the parameter) after setting it, or set it after the step")
    for slot, _ in found:
        point(slot.param, placeholder(slot.dtype, slot.shape))
