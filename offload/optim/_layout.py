"""How an optimizer's parameters are laid out: the typed records, and the pure function that
cuts parameters into shards.

A *shard* is a run of at most a shard size of elements, a list of *segments* (a slice of
one flattened parameter). Each shard keeps in the store ``state`` (fp32 rows: the master
weights where needed, then the moments) and, for wrapped parameters, ``grad`` (the fp32
gradient accumulator). The same function lays out a live optimizer and ``offload.plan``'s
optimizer rows (``_sizing``), so the plan is the layout the optimizer builds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..store import Tier
from ._formats import BLOCK, Packing, StateFormat, packing_for

__all__ = ["check_dtype", "Owner", "MasterMode", "master_mode", "Segment", "Shard", "ParamEntry", "Placement", "Item",
           "cut", "staggered", "check_master_format", "expected_gradients", "DEFAULT_SHARD", "HOST_PLAIN_SHARD", "MIN_SHARD", "SHARDS_IN_FLIGHT"]

DEFAULT_SHARD = 16 << 20  # elements: 64 MiB per fp32 row
# fp32 CPU parameters of no wrapped model, states in host memory: nothing is read or written,
# so shards only add per-call overhead (a fused call, a store lookup each). 1 GiB per row.
HOST_PLAIN_SHARD = 1 << 28
MIN_SHARD = 1 << 12  # elements: below this, per-call overhead outweighs what a smaller budget saves
SHARDS_IN_FLIGHT = 4  # read ahead (two), being updated, being written back
# Note: row stagger. The rows of a shard are streamed side by side by one kernel, and their
# buffer is on huge pages, so physically contiguous: rows a large power of two apart contend
# for the same cache sets and memory banks (docs/architecture.md, "Row layout").
_ROW_STAGGER = 4 << 10


class Owner(NamedTuple):
    """Where a wrapped parameter lives: its model's manager (None in a plan), parameter group
    (this rank's slice with several ranks) and slot."""
    manager: Any
    group: Any
    slot: Any


class MasterMode(enum.Enum):
    """How a parameter's fp32 master weights are kept."""
    ROW = "row"  # an fp32 master row in the shard's states (another dtype, or a tier the step cannot update)
    GROUP = "group"  # its fp32 group rests on NVMe or in host memory: updated in a host copy of the group
    PARAM = "param"  # an fp32 CPU tensor (resident on a CPU device, or plain): updated where it is


def master_mode(slot_dtype: torch.dtype, *, resident: bool, group_fp32: bool, param_home: Tier | None,
                cpu: bool) -> MasterMode:
    """The one rule for a wrapped parameter (``param_home``: its group's tier) or a plain one
    (``param_home`` None: ``cpu`` says whether it is a CPU tensor)."""
    if slot_dtype != torch.float32:
        return MasterMode.ROW
    if param_home is None or resident:
        return MasterMode.PARAM if cpu else MasterMode.ROW
    if param_home in (Tier.NVME, Tier.HOST) and group_fp32:
        return MasterMode.GROUP
    return MasterMode.ROW


@dataclass(eq=False)
class Segment:
    param: torch.Tensor
    start: int  # first element in the flattened parameter
    length: int
    offset: int  # first element in the shard
    group_index: int  # torch param group
    step: torch.Tensor  # this segment's step count (a split parameter's segments stay equal)
    owner: Owner | None = None  # a wrapped parameter's
    has_grad: bool = False  # a gradient arrived since zero_grad()
    zeroed: bool = False  # held, and all zeros (zero_grad(set_to_none=False)) until the next add
    shard: "Shard | None" = None
    # noted when the accumulator was written (wrapped only): what p.grad's norms answer
    sumsq: float = 0.0
    maxabs: float = 0.0
    # p.grad = the held sum x scale / loss scale: factors noted by p.grad.mul_(c) (clipping)
    # and, on host sums the fused kernel unscaled in place, the loss scale
    scale: float = 1.0
    # a split parameter's squared norm taken over its whole gradient as it arrived (torch's
    # own sum, which the pieces' sums only approach); None once the sum is anything else
    whole: float | None = None
    # sumsq and maxabs were divided, not taken, after an update changed the sum in place
    # (``_pipeline``): right to a last bit only, so p.grad's norms and a clip take them again
    approx: bool = False
    number: int = 0  # the parameter's place among the optimizer's, in the order given (``ParamEntry``)


@dataclass(eq=False)
class Shard:
    index: int
    store: Any  # its TensorStore (None in a plan)
    home: Tier  # where the states rest
    numel: int
    rows: int
    master: bool
    wrapped: bool
    segments: list[Segment] = field(default_factory=list)
    fmt: StateFormat = StateFormat.FP32  # how the moment rows are stored (``_formats``)
    names: tuple[str, ...] = ()  # the moment rows' names (the master row, where kept, comes first)
    master_fmt: StateFormat = StateFormat.FP32  # how the master row is stored (fp32, or bf16 rounded stochastically)
    grad_home: Tier | None = None  # where the fp32 gradient rests (wrapped only): host when the budget allows
    expected: int = 0  # distinct parameters that report a gradient per backward
    # the gradient sink's books (``_sink``)
    grad_valid: bool = False  # the stored grad holds this cycle's accumulation
    acc: torch.Tensor | None = None  # open fp32 accumulator during backward
    acc_buffer: Any = None  # its HostBuffer when the grad does not rest in host memory
    drained: set = field(default_factory=set)
    sumsq: float = 0.0
    maxabs: float = 0.0
    finite: bool = True

    @property
    def state_key(self) -> str:
        return f"optim/{id(self):x}/state"

    @property
    def grad_key(self) -> str:
        return f"optim/{id(self):x}/grad"

    @property
    def packing(self) -> Packing:
        return packing_for((["master_param"] if self.master else []) + list(self.names), self.fmt, self.numel,
                           self.master_fmt)

    @property
    def packed(self) -> bool:
        """Whether the rows rest coded (``_formats``): the update decodes them into a scratch buffer."""
        return coded(self.rows, self.master, self.fmt, self.master_fmt)

    @property
    def master_bytes(self) -> int:
        """Bytes of the master row as it rests (0 without one)."""
        return self.packing.row_bytes(self.packing.codes[0]) if self.master else 0

    @property
    def state_bytes(self) -> int:
        return self.packing.nbytes if self.packed else self.rows * self.numel * 4

    @property
    def scratch_bytes(self) -> int:
        """Host bytes of the fp32 rows a packed shard's update decodes into (from the store's pool)."""
        return self.rows * self.numel * 4 if self.packed else 0

    @property
    def grad_bytes(self) -> int:
        return self.numel * 4 if self.wrapped else 0

    @property
    def bytes_in_flight(self) -> int:
        """Host bytes the step holds for this shard while it is read, updated and written."""
        if self.home is Tier.HOST:
            return 0
        return self.state_bytes + (self.grad_bytes if self.grad_home is not Tier.HOST else 0)

    @property
    def host_resting_bytes(self) -> int:
        """Host bytes kept between steps (states in the host tier, a gradient kept in host memory)."""
        states = self.state_bytes if self.home is Tier.HOST else 0
        return states + (self.grad_bytes if self.grad_home is Tier.HOST else 0)

    @property
    def nvme_bytes(self) -> int:
        states = self.state_bytes if self.home is Tier.NVME else 0
        return states + (self.grad_bytes if self.grad_home is Tier.NVME else 0)

    @property
    def reads_grad(self) -> bool:
        """Whether the step reads the gradient from a tier other than host memory."""
        return self.wrapped and self.grad_home is not Tier.HOST

    def group_copy_bytes(self, param_home: Tier | None) -> int:
        """Host bytes of the group copies updating this shard reads (whole groups: fp32
        groups resting on NVMe, updated in place; a group spanning shards stays until its
        last one is done)."""
        return sum(self.group_copy_sizes(param_home))

    def group_copy_sizes(self, param_home: Tier | None) -> list[int]:
        """The bytes of each group copy ``group_copy_bytes`` counts."""
        if not self.wrapped or self.master or param_home is not Tier.NVME:
            return []
        return list({id(s.owner.group): s.owner.group.nbytes for s in self.segments
                     if not s.owner.group.resident}.values())

    @property
    def host_reads(self) -> list[str]:
        """The store keys the step reads into host memory (none where the states rest there)."""
        if self.home is Tier.HOST:
            return []
        return ([self.state_key] if self.rows else []) + ([self.grad_key] if self.reads_grad else [])

    @property
    def holds_gradient(self) -> bool:
        """A wrapped shard whose stored sum holds a gradient the step takes."""
        return self.grad_valid and any(s.has_grad for s in self.segments)

    @property
    def takes_step(self) -> bool:
        """The step updates it: a gradient is held (wrapped), or a parameter has ``p.grad``."""
        if self.wrapped:
            return self.holds_gradient
        return any(s.param.grad is not None for s in self.segments)


@dataclass(eq=False)
class ParamEntry:
    """One parameter given to the optimizer: where it lives and the segments that hold it."""
    param: torch.Tensor
    group_index: int
    owner: Owner | None
    segments: list[Segment] = field(default_factory=list)
    laid_out: bool = False  # (a rank's slice may hold none of its elements: no segments)
    hooked: bool = False  # its gradients come to the optimizer's sink
    empty_grad: bool = False  # a 0-element parameter (no segments) got a gradient: p.grad is an empty tensor
    # its place among the optimizer's parameters: what its bf16 master's stochastic rounding
    # draws from (with its step and element), so a resume into another shard layout rounds alike
    number: int = 0


@dataclass(frozen=True)
class Placement:
    """Where some parameters' states go, and what else shares that store's host budget."""
    store: Any  # TensorStore (None in a plan)
    key: int  # identity of the store: shards never mix stores
    home: Tier  # the optimizer tier
    host_budget: int
    write_back: int = 0  # host bytes the step needs to write a group back to the parameter tier
    param_staging: int = 0  # host bytes the wrapped model's parameter reads stage through
    param_home: Tier | None = None  # where the wrapped model's parameter groups rest
    resting: int = 0  # host bytes earlier layouts of this store keep resting there
    device_staging: int = 0  # host bytes of gradient copies and parameter staging on a device
    params: int = 0  # host pool bytes of the wrapped model's parameter groups at home there


@dataclass(frozen=True)
class Item:
    """One parameter to lay out: elements ``[start, stop)`` of it (a rank's slice)."""
    param: torch.Tensor
    group_index: int
    owner: Owner | None
    rows: int  # state rows of its param group, the master row not counted
    master: bool
    placement: Placement
    start: int
    stop: int
    fmt: StateFormat = StateFormat.FP32  # the optimizer's moments= setting
    names: tuple[str, ...] = ()  # its param group's state rows (``rows`` of them)
    master_fmt: StateFormat = StateFormat.FP32  # the optimizer's master= setting
    number: int = 0  # ParamEntry.number


# A split parameter's pieces hold whole multiples of this many elements: the fused kernels
# run a piece's last partial vector as scalars (torch's whole-tensor run vectorises those
# elements, and their last bits differ). 64 fp32 covers every CPU vector width.
_PIECE = 64


def cut(items: list[Item], *, first_index: int, shard_size: int | None,
        grad_room: dict[int, int], split_groups: bool = False) -> list[Shard]:
    """Consecutive segments of ``items`` into shards that share a store, a master layout
    and a row count; wrapped shards' gradients rest in host memory while ``grad_room`` (per
    store key, bytes) lasts. ``split_groups``: no shard spans two parameter groups updated
    in host copies (``copies_group``), so that one in flight holds one group. The caller
    finds each parameter's segments through ``Segment.param``."""
    shards: list[Shard] = []
    keys: dict[int, int] = {}  # id(shard) -> its placement's key
    current: Shard | None = None
    for item in items:
        p = item.placement
        wrapped = item.owner is not None
        rows = int(item.master) + item.rows
        packs = coded(rows, item.master, item.fmt, item.master_fmt)
        size = shard_elements(p, rows, wrapped, item.master, copies_group(item), shard_size, grad_room.get(p.key, 0),
                              item_bytes(item))
        if packs:  # whole blocks, each segment starting one (``_formats``)
            size = max(BLOCK, size // BLOCK * BLOCK)
        start, first = item.start, None
        while start < item.stop:
            at = round_up(current.numel, BLOCK) if packs and current is not None else None
            if current is None or current.store is not p.store or current.master != item.master \
                    or current.rows != rows or current.wrapped != wrapped or current.fmt is not item.fmt \
                    or current.names != item.names or current.master_fmt is not item.master_fmt \
                    or (at if at is not None else current.numel) >= size \
                    or (split_groups and copies_group(item) and current.segments
                        and getattr(current.segments[-1].owner, "group", item.owner.group) is not item.owner.group):
                current = Shard(first_index + len(shards), p.store, p.home, 0, rows, item.master, wrapped,
                                fmt=item.fmt, names=item.names, master_fmt=item.master_fmt)
                shards.append(current)
                keys[id(current)] = p.key
            elif at is not None:
                current.numel = at
            take = min(item.stop - start, size - current.numel)
            if take < item.stop - start and size >= _PIECE:  # a split parameter: whole vectors per piece
                take -= take % _PIECE
                if take == 0:  # (less room left than one piece: the next shard)
                    current = None
                    continue
            step = torch.zeros((), dtype=torch.float32) if first is None else first.step.clone()
            seg = Segment(item.param, start, take, current.numel, item.group_index, step,
                          owner=item.owner, shard=current, number=item.number)
            first = first or seg
            current.segments.append(seg)
            current.numel += take
            start += take
    room = dict(grad_room)
    for shard in shards:
        if shard.packed:
            shard.numel = round_up(shard.numel, BLOCK)  # (staggered keeps whole blocks)
        shard.numel = staggered(shard.numel)  # unused elements at the end of each row
        shard.expected = expected_gradients(shard)
        if shard.wrapped:
            key = keys[id(shard)]
            shard.grad_home = shard.home
            if shard.home is not Tier.HOST and room.get(key, 0) >= shard.grad_bytes:
                shard.grad_home = Tier.HOST
                room[key] -= shard.grad_bytes
    return shards


def expected_gradients(shard: Shard) -> int:
    """How many parameters' gradients a backward brings to ``shard`` (its accumulator is
    written out once they are in): those that require grad now."""
    return len({id(s.param) for s in shard.segments if s.param.requires_grad})


def copies_group(item: Item) -> bool:
    """Whether updating ``item`` reads its group into a host copy (fp32 groups resting on
    NVMe are their own masters, updated in a copy of the group: ``MasterMode.GROUP``)."""
    return item.owner is not None and not item.master and not item.owner.group.resident \
        and item.placement.param_home is Tier.NVME


def coded(rows: int, master: bool, fmt: StateFormat, master_fmt: StateFormat) -> bool:
    """Whether a shard of ``rows`` state rows (``master``: the first is a master row) rests
    coded: some row is not fp32."""
    return rows > 0 and (fmt is not StateFormat.FP32 or (master and master_fmt is not StateFormat.FP32))


def check_master_format(fmt: StateFormat, dtype: torch.dtype, shape: tuple) -> None:
    """Refuse a bf16 master row for a parameter that is not bf16 (it would be coarser than
    the parameter itself)."""
    if fmt is StateFormat.BF16 and dtype is not torch.bfloat16:
        raise ValueError(f"master='bf16' keeps the master weights of bf16 parameters in bf16; a parameter of "
                         f"shape {shape} is {dtype} (its master would be coarser than itself): use "
                         "master='fp32', or run the model in bf16 (OffloadConfig(compute_dtype='bf16'))")


def item_bytes(item: Item) -> tuple[float, int]:
    """Bytes per element of ``item``'s stored rows, and of the fp32 rows its update decodes
    them into (0 where the rows rest as fp32)."""
    rows = int(item.master) + item.rows
    if not coded(rows, item.master, item.fmt, item.master_fmt):
        return 4.0 * rows, 0
    packing = packing_for((["master_param"] if item.master else []) + list(item.names), item.fmt, BLOCK,
                          item.master_fmt)
    return packing.nbytes / BLOCK, 4 * rows


def shard_elements(p: Placement, rows: int, wrapped: bool, master: bool, copies: bool, shard_size: int | None,
                   grad_room: int, row_bytes: tuple[float, int] | None = None) -> int:
    """Elements per shard: as given, or by the host bytes a shard holds while in flight
    (``row_bytes``: ``item_bytes``; default fp32 rows)."""
    stored, scratch = row_bytes if row_bytes is not None else (4.0 * rows, 0)
    if shard_size is not None:
        return shard_size
    if p.home is Tier.HOST and not copies and not scratch:
        # plain fp32 parameters are updated where they are, with no staging: fewer calls
        return HOST_PLAIN_SHARD if not wrapped and not master else DEFAULT_SHARD
    # the shards in flight within the host budget, next to the staging that writes a
    # parameter group's new values back and the gradients kept in host memory: each holds
    # its rows and gradient read from NVMe, and the host copies of groups updated in place;
    # coded rows are decoded, one shard at a time, into fp32 scratch
    per_element = (stored + (4 if wrapped else 0) if p.home is Tier.NVME else 0) + (4 if copies else 0)
    budget = p.host_budget - p.params - (p.write_back if wrapped else 0) - grad_room
    return max(MIN_SHARD, min(DEFAULT_SHARD, int(budget // (SHARDS_IN_FLIGHT * per_element + scratch))))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def staggered(numel: int) -> int:
    """``numel`` rounded up so that rows of that many fp32 elements start ``_ROW_STAGGER``
    apart modulo 2 MiB (128 KiB for rows under 16 MiB); rows under 1 MiB are left alone."""
    row = numel * 4
    if row < (1 << 20):
        return numel
    period = 2 << 20 if row >= 16 << 20 else 128 << 10
    return numel + ((_ROW_STAGGER - row) % period) // 4


def check_dtype(p: torch.Tensor) -> None:
    """The update runs in fp32 rows: a wider or complex parameter would not train as torch's."""
    if p.dtype.is_complex or p.dtype == torch.float64:
        lost = "drop its imaginary part" if p.dtype.is_complex else "train it at float32 precision"
        raise TypeError(f"a {p.dtype} parameter of shape {tuple(p.shape)}: offload's optimizers update in "
                        f"float32 rows and would {lost}, unlike torch's. Give it to a torch optimizer of its "
                        "own (a plain parameter), or convert the model to float32, bf16 or fp16 before offload.wrap")
