"""Which parameter groups are read where the checkpoint holds them (``read_in_place``).

A group rests in the checkpoint's files, one range per tensor, when its parameters rest
on NVMe and every tensor is in the file as the model computes on it: the same dtype, the
same bytes. Its tensors are then laid out in its buffer as in the file, modulo a block
(``align_to_files``): each tensor of ``DIRECT_MIN`` bytes or more starts where its file
offset does, modulo 4 KiB, so the file engine reads its aligned body with O_DIRECT
straight into place (no bounce copy). A file offset that is not a multiple of 16 (half of
all safetensors files put every tensor 8 bytes off) starts that many bytes earlier: it is
read to where the file's offset agrees and moved down once it has landed
(``CheckpointRange.shift``), so every such tensor keeps 16 bytes of alignment. The smaller
tensors keep the usual 256-byte slots and are read buffered. The padding costs under 4 KiB
per large tensor, and those tensors are 16-byte aligned rather than 256; groups of the
same tensors take the largest of their sizes, so that their buffers are reused across
passes. The rest are copied into swap files at
``wrap``, as without the setting: groups that stay on the device (resident), tensors the
file holds in another dtype (a bf16 model from an fp32 file: each is converted once), a
rank's slices of a partitioned model. A group read in place moves to a swap file on its
first write (the optimizer's update, ``load_state_dict``): the checkpoint is never written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .._units import PARAM_ALIGN, format_size
from ..store import CheckpointRange, TensorStore
from ._groups import ParamGroup

__all__ = ["InPlaceChoice", "InPlaceLayout", "choose_in_place", "align_to_files", "adopt_groups"]

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT's alignment on the disks offload runs on (a page; logical blocks are at most that)
DIRECT_MIN = 64 << 10  # smaller tensors are read buffered in full: not worth a block of padding
MIN_ALIGN = 16  # a tensor placed as in its file keeps at least this alignment (vector loads, fp8 kernels)


@dataclass
class InPlaceChoice:
    """Groups read in place, and the ones copied with the reason for each."""

    adopted: list[ParamGroup] = field(default_factory=list)
    copied: dict[str, list[ParamGroup]] = field(default_factory=dict)  # reason -> groups

    @property
    def in_place_bytes(self) -> int:
        return sum(g.nbytes for g in self.adopted)

    @property
    def trainable_bytes(self) -> int:
        """Bytes read in place that an optimizer would write (and so copy on first write)."""
        return sum(g.nbytes for g in self.adopted if any(s.param.requires_grad for s in g.slots))

    def describe(self) -> str:
        parts = [f"{len(self.adopted)} parameter groups ({format_size(self.in_place_bytes)}) read in place "
                 "from the checkpoint, tensor by tensor"]
        for reason, groups in self.copied.items():
            parts.append(f"{len(groups)} copied ({format_size(sum(g.nbytes for g in groups))}: {reason})")
        return "; ".join(parts)


class InPlaceLayout:
    """``device_layout``'s ``place`` hook: sorts the groups it builds (``choose_in_place``)
    and lays the adopted ones out as their files (``align_to_files``) before they are
    measured; ``choice`` is the last sorting."""

    def __init__(self, reader: Any, config: Any, *, partitioned: bool):
        self.reader, self.config, self.partitioned = reader, config, partitioned
        self.choice = InPlaceChoice()

    def __call__(self, groups: list[ParamGroup]) -> None:
        self.choice = choose_in_place(groups, self.reader, self.config, partitioned=self.partitioned)
        align_to_files(self.choice, self.reader)


def choose_in_place(groups: list[ParamGroup], reader: Any, config: Any, *, partitioned: bool) -> InPlaceChoice:
    """Sort ``groups`` into read in place and copied, as ``wrap`` would (``reader``: the
    checkpoint's ``CheckpointReader``; None copies nothing and adopts nothing)."""
    choice = InPlaceChoice()
    if reader is None:
        return choice
    for group in groups:
        if group.resident:
            continue  # (on the device for the whole run: not read again)
        reason = _why_copied(group, reader, config, partitioned)
        if reason is None:
            choice.adopted.append(group)
        else:
            choice.copied.setdefault(reason, []).append(group)
    return choice


def _why_copied(group: ParamGroup, reader: Any, config: Any, partitioned: bool) -> str | None:
    if config.param_tier != "nvme":
        return f"param_tier={config.param_tier!r} keeps them in memory"
    if not config.read_in_place:
        return "read_in_place=False"
    if partitioned:
        return "each rank keeps a slice of its own"
    for slot in group.slots:
        entry = reader.entries[reader.name_of(slot)]
        if entry.dtype != slot.dtype:
            return f"the checkpoint holds {str(entry.dtype).removeprefix('torch.')}, the model computes in " \
                   f"{str(slot.dtype).removeprefix('torch.')}: converted once"
        if entry.end - entry.start != slot.nbytes:
            return "a tensor's size in the file differs from the parameter's"
        if entry.start % slot.dtype.itemsize:
            return "a tensor starts in the file at an offset its dtype cannot view"
    return None


def align_to_files(choice: InPlaceChoice, reader: Any) -> None:
    """Lay each adopted group's tensors out as their file does, modulo ``BLOCK`` (see the
    module's docstring); before anything sizes buffers from the groups."""
    for group in choice.adopted:
        end = 0
        for slot in group.slots:
            start = reader.entries[reader.name_of(slot)].start
            shift = _shift(slot, start)
            if shift is None:
                slot.offset = -(-end // PARAM_ALIGN) * PARAM_ALIGN
            else:  # (read to offset + shift, where the file's offset agrees; moved down to offset)
                slot.offset = end + (start - shift - end) % BLOCK
            end = slot.offset + slot.nbytes + (shift or 0)
        group.nbytes = end
    _equal_sizes(choice.adopted)


def _shift(slot: Any, start: int) -> int | None:
    """How far past its place a tensor at file offset ``start`` is read (its offset modulo
    ``MIN_ALIGN``), or None for a tensor read buffered in full (a small one)."""
    return start % MIN_ALIGN if slot.nbytes >= DIRECT_MIN else None


def _equal_sizes(groups: list[ParamGroup]) -> None:
    """Give groups of the same tensors (a model's repeated layers) one size, the largest
    their paddings need: the buffer pool reuses freed buffers by exact size, and a few
    bytes' difference per layer (up to 4 KiB per large tensor) made the pool map new buffers."""
    keys = [tuple((slot.dtype, tuple(slot.shape)) for slot in group.slots) for group in groups]
    largest: dict[tuple, int] = {}
    for key, group in zip(keys, groups):
        largest[key] = max(largest.get(key, 0), group.nbytes)
    for key, group in zip(keys, groups):
        group.nbytes = largest[key]


def adopt_groups(choice: InPlaceChoice, reader: Any, store: TensorStore) -> None:
    """Give each adopted group its home in the checkpoint files (nothing read or written)."""
    for group in choice.adopted:
        ranges = []
        for slot in group.slots:
            entry = reader.entries[reader.name_of(slot)]
            ranges.append(CheckpointRange(store.open_checkpoint(entry.path), entry.start, slot.nbytes, slot.offset,
                                          _shift(slot, entry.start) or 0))
        store.adopt(group.key, torch.uint8, (group.nbytes,), ranges)  # (groups are kept as bytes)
