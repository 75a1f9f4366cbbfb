"""Which parameter groups are read where the checkpoint holds them (``read_in_place``).

A group rests in the checkpoint's files when its parameters rest on NVMe and every tensor
is in the file as the model computes on it: the same dtype, the same bytes. Its tensors
are then laid out in its buffer as in the file (``align_to_files``). Tensors that lie next
to each other in a file form one run (safetensors sorts a file's tensors by dtype, then
by name, so a module's tensors of one dtype lie together), laid out byte for byte as the
file holds them, the few bytes between them included, and read as one range: one request
per run, not one per tensor, and the small tensors (biases, norms) ride along. A run is
read as the 4 KiB blocks of its file that cover it, landing where a block starts in the
group's buffer, so the file engine reads all of it with O_DIRECT straight into place:
nothing goes through the page cache, at a cost of under 8 KiB of the file's neighbouring
bytes per run. A run's tensors share their file offset
modulo 16 (a tensor at another one starts a new run). When that is not 0 (half of all
safetensors files put every tensor 8 bytes off), the run's bytes are moved down that much
once landed (``CheckpointRange.shift``), so every tensor is 16-byte aligned (not 256 as in
swap-backed groups). Runs also take the bytes between their tensors (see ``_runs``); groups
of the same tensors take the largest of their sizes, so that their buffers are reused across
passes. The rest are copied into swap files at ``wrap``, as without the setting: groups
that stay on the device (resident), tensors the file holds in another dtype (a bf16 model
from an fp32 file: each is converted once), a rank's slices of a partitioned model. A
group read in place moves to a swap file on its first write (the optimizer's update,
``load_state_dict``): the checkpoint is never written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .._units import format_size
from ..store import CheckpointRange, TensorStore
from ._groups import ParamGroup

__all__ = ["InPlaceChoice", "InPlaceLayout", "choose_in_place", "align_to_files", "adopt_groups"]

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT's alignment on the disks offload runs on (a page; logical blocks are at most that)
GAP_MAX = 64 << 10  # tensors further apart in a file are two runs: the bytes between are not worth reading
# A tensor placed as in its file keeps at least this alignment: vector loads and fp8 kernels
# want it, and torch's fp32 matrix-vector product gives other bits for a weight 8 bytes off
# 16 than at 16 or 64 (docs/benchmarks.md), so placing it less aligned would part the results
# from the copying path's and the in-memory model's.
MIN_ALIGN = 16


@dataclass
class _Run:
    """Tensors of one group next to each other in one file (see ``_runs``), at the same
    file offset modulo ``MIN_ALIGN``: read as one range."""

    path: str
    start: int  # the first tensor's file offset
    end: int  # the last tensor's end
    slots: list = field(default_factory=list)  # (slot, its file offset), in file order
    read_start: int = 0  # the covering blocks' file offset
    read_length: int = 0  # and length (to the file's end at most)
    dest: int = 0  # where the covering blocks land in the group's buffer
    shift: int = 0  # the tensors' bytes are moved that much down once landed

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class InPlaceChoice:
    """Groups read in place, and the ones copied with the reason for each."""

    adopted: list[ParamGroup] = field(default_factory=list)
    copied: dict[str, list[ParamGroup]] = field(default_factory=dict)  # reason -> groups
    runs: dict[str, list[_Run]] = field(default_factory=dict)  # group key -> its runs as laid out (align_to_files)

    @property
    def ranges(self) -> int:
        """The file ranges the adopted groups are read as: one per run."""
        return sum(len(runs) for runs in self.runs.values())

    @property
    def in_place_bytes(self) -> int:
        """The tensors' bytes the checkpoint serves (what the model would copy)."""
        return sum(slot.nbytes for g in self.adopted for slot in g.slots)

    @property
    def buffer_bytes(self) -> int:
        """The adopted groups' buffers: the tensors, the bytes between them and the covering
        blocks' ends (what the device budget and a copy on first write take)."""
        return sum(g.nbytes for g in self.adopted)

    @property
    def trainable_bytes(self) -> int:
        """Bytes read in place that an optimizer would write (and so copy on first write)."""
        return sum(g.nbytes for g in self.adopted if any(s.param.requires_grad for s in g.slots))

    def describe(self) -> str:
        parts = [f"{len(self.adopted)} parameter groups ({format_size(self.in_place_bytes)} of tensors) read in "
                 f"place from the checkpoint, in {self.ranges} ranges of neighbouring tensors read as whole 4 KiB "
                 f"blocks ({format_size(self.buffer_bytes)})"]
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
        if reader.built_from_several(reader.name_of(slot)):
            return "transformers builds a parameter of several tensors of the file (fused experts): built once"
        entry = reader.entries[reader.name_of(slot)]
        if entry.dtype != slot.dtype:
            return f"the checkpoint holds {str(entry.dtype).removeprefix('torch.')}, the model computes in " \
                   f"{str(slot.dtype).removeprefix('torch.')}: converted once"
        if entry.end - entry.start != slot.nbytes:
            return "a tensor's size in the file differs from the parameter's"
        if entry.start % slot.dtype.itemsize:
            return "a tensor starts in the file at an offset its dtype cannot view"
    return None


def _runs(group: ParamGroup, reader: Any) -> list[_Run]:
    """``group``'s tensors as runs, in file order. The bytes between two tensors of a run are
    read and held along (and ``_equal_sizes`` gives every group of the same tensors that
    room): at most ``GAP_MAX``, and an eighth of the run so far beyond a block."""
    placed = sorted(((reader.entries[reader.name_of(slot)], slot) for slot in group.slots),
                    key=lambda e: (e[0].path, e[0].start))
    runs: list[_Run] = []
    for entry, slot in placed:
        last = runs[-1] if runs else None
        if last is None or last.path != entry.path \
                or not 0 <= entry.start - last.end <= min(GAP_MAX, max(BLOCK, last.length // 8)) \
                or entry.start % MIN_ALIGN != last.start % MIN_ALIGN:
            last = _Run(entry.path, entry.start, entry.end)
            runs.append(last)
        last.slots.append((slot, entry.start))
        last.end = entry.end
    return runs


def align_to_files(choice: InPlaceChoice, reader: Any) -> None:
    """Lay each adopted group's tensors out as their file does (see the module's docstring);
    before anything sizes buffers from the groups."""
    choice.runs = {}
    sizes: dict[str, int] = {}
    for group in choice.adopted:
        end = 0
        runs = choice.runs[group.key] = _runs(group, reader)
        for run in runs:
            if run.path not in sizes:
                sizes[run.path] = os.path.getsize(run.path)
            head = run.start % BLOCK
            run.read_start = run.start - head
            run.read_length = min(-(-run.end // BLOCK) * BLOCK, sizes[run.path]) - run.read_start
            run.dest = -(-end // BLOCK) * BLOCK  # (where the covering blocks land)
            run.shift = run.start % MIN_ALIGN
            place = run.dest + head - run.shift  # (where the first tensor rests once moved down)
            for slot, start in run.slots:
                slot.offset = place + start - run.start
            end = run.dest + run.read_length
        group.nbytes = end
    _equal_sizes(choice.adopted)


def _equal_sizes(groups: list[ParamGroup]) -> None:
    """Give groups of the same tensors (a model's repeated layers) one size, the largest
    their paddings need: the buffer pool reuses freed buffers by exact size, and a few
    bytes' difference per layer (up to 4 KiB per run) made the pool map new buffers."""
    keys = [tuple((slot.dtype, tuple(slot.shape)) for slot in group.slots) for group in groups]
    largest: dict[tuple, int] = {}
    for key, group in zip(keys, groups):
        largest[key] = max(largest.get(key, 0), group.nbytes)
    for key, group in zip(keys, groups):
        group.nbytes = largest[key]


def adopt_groups(choice: InPlaceChoice, store: TensorStore) -> None:
    """Give each adopted group its home in the checkpoint files: a range per run, as
    ``align_to_files`` laid them out (nothing read or written)."""
    for group in choice.adopted:
        ranges = [CheckpointRange(store.open_checkpoint(run.path), run.read_start, run.read_length, run.dest,
                                  run.shift, run.start - run.read_start, run.length)
                  for run in choice.runs[group.key]]
        store.adopt(group.key, torch.uint8, (group.nbytes,), ranges)  # (groups are kept as bytes)
