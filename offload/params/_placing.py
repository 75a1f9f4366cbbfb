"""Placing a model's values in the store at ``wrap``: each group's flat bytes (from the
model or streamed from a checkpoint), the fp32 values the compute dtype rounds, and the
buffers on the compute device."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..store import Tier, TensorStore
from ._coordinator import Coordinator
from ._groups import ParamGroup
from ._originals import Originals, narrows

__all__ = ["load_groups", "move_buffers"]

log = logging.getLogger(__name__)


def load_groups(model: nn.Module, groups: list[ParamGroup], store: TensorStore,
                 coordinator: Coordinator, home: Tier, reader: Any, partition: Any = None,
                 originals: Originals | None = None, in_place: frozenset[str] = frozenset()) -> None:
    """Each group's flat bytes into the store, one group in host memory at a time (with
    several ranks, only this rank's slice of it); the fp32 values of trained parameters
    the compute dtype rounds into ``originals``. Groups in ``in_place`` are already in the
    store (``adopt_groups``): their parameters only become placeholders."""
    rounded: list[str] = []
    for group in groups:
        for slot in group.slots:
            if slot.param.device.type == "meta":  # a meta tensor cannot take real .data
                _replace_param(model, slot)
        if group.key in in_place:
            for slot in group.slots:
                slot.param.data = coordinator.placeholder(slot.dtype, slot.shape)
            continue
        flat = torch.empty(group.nbytes, dtype=torch.uint8)
        wide: dict[int, torch.Tensor] = {}
        for slot in group.slots:
            source = reader.tensor(slot) if reader is not None else slot.param.detach()
            view = flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            view.copy_(source)
            if narrows(source, slot):
                wide[id(slot)] = source
        if wide and partition is None and originals is not None:
            originals.keep(group, wide)
        elif wide:
            rounded.append(group.key)
        del wide
        if partition is not None:
            size = partition.slice_bytes(group.nbytes)
            mine = torch.zeros(size, dtype=torch.uint8)
            begin = partition.rank * size
            piece = flat[begin: begin + size]
            mine[: piece.numel()].copy_(piece)
            flat = mine
        store.put(group.key, flat, Tier.DEVICE if group.resident else home)
        del flat
        if group.resident:
            out = store.wait(group.key, Tier.DEVICE)
            for slot in group.slots:
                slot.param.data = out[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        else:
            for slot in group.slots:
                slot.param.data = coordinator.placeholder(slot.dtype, slot.shape)
    for group in groups:
        store.wait(group.key, Tier.DEVICE if group.resident else home)
    if rounded:
        log.warning("offload: with several ranks the fp32 values that compute_dtype rounds are not kept: the "
                    "optimizer's master weights of %d groups start from the rounded values (first: %s). Cast the "
                    "model to the compute dtype before wrap to say so explicitly", len(rounded), rounded[0])


def _replace_param(model: nn.Module, slot: Any) -> None:
    old = slot.param
    new = nn.Parameter(torch.empty(0, dtype=slot.dtype), requires_grad=old.requires_grad)
    for name in slot.names:
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._parameters[attr] = new
    slot.param = new


def move_buffers(model: nn.Module, device: torch.device, reader: Any) -> None:
    persistent = set(model.state_dict().keys()) if reader is not None else set()
    for module_name, module in model.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            if full in persistent and reader.has(full):  # (a saved buffer's value is the checkpoint's, as
                # from_pretrained loads it: final_logits_bias, batch-norm statistics; not the built one's)
                saved = reader.get(full)
                if buf.device.type != "meta":
                    if tuple(saved.shape) != tuple(buf.shape):
                        raise ValueError(f"buffer {full!r}: checkpoint {tuple(saved.shape)}, model "
                                         f"{tuple(buf.shape)}. Build the model from the config the checkpoint "
                                         "was saved with")
                    saved = saved.to(buf.dtype)
                buf = saved
            elif buf.device.type == "meta":
                raise ValueError(
                    f"buffer {full!r} is on the meta device and not in the checkpoint: build the "
                    "model with offload.init_empty_weights() (parameters on meta, buffers real) "
                    "or include the buffer in the checkpoint")
            module._buffers[name] = buf.to(device)
