"""The optimizer's sizing policy, the one ``offload.plan`` reports too: where each
parameter's states and gradient rest, how large the shards are, and the host budget checks.

``plan_rows`` runs the same layout (``_layout.cut``) over a model's parameter groups without
allocating anything, so a plan states what the optimizer will build.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from .._plan import PlanRow, check_disk, check_ram
from .._units import format_apart, format_size
from ..accel import host_compute
from ..io import PAGE_SIZE, BudgetError, round_up
from ..store import Tier
from ._coding import compile_bytes
from ._formats import BLOCK, StateFormat
from ._layout import (MIN_SHARD, SHARDS_IN_FLIGHT, Item, MasterMode, check_master_format, coded, Owner, Placement, Shard, cut, master_mode)
from ._staging import GRAD_COPIES

__all__ = ["grad_room", "check_host_budget", "checkpoint_load_bytes", "check_machine", "largest_in_flight", "in_flight_bytes", "cut_to_fit",
           "params_at_home", "resting_bytes", "write_back_bytes", "wrapped_mode", "plan_rows"]

log = logging.getLogger(__name__)

def wrapped_mode(owner: Owner, param_home: Tier, cpu: bool) -> MasterMode:
    """``master_mode`` of a wrapped parameter, from its group and slot."""
    group, slot = owner.group, owner.slot
    return master_mode(slot.dtype, resident=group.resident, param_home=param_home, cpu=cpu,
                       group_fp32=all(s.dtype == torch.float32 for s in group.slots))


def params_at_home(groups: Iterable[Any], param_home: Tier) -> int:
    """Host pool bytes of parameter groups whose home is host memory (the optimizer's shards
    share that pool with them)."""
    if param_home is not Tier.HOST:
        return 0
    return sum(_pages(g.nbytes) for g in groups if not g.resident)


def write_back_bytes(groups: Iterable[Any], param_home: Tier) -> int:
    """Host bytes the step needs to write parameter groups assembled from master rows back
    to NVMe: a staging buffer of the largest group, two at once (a shard may finish one
    group and start the next). All-fp32 groups are updated in their own host copies
    (``Shard.group_copy_bytes``) and need none."""
    if param_home is not Tier.NVME:
        return 0
    sizes = sorted((_pages(g.nbytes) for g in groups if not g.resident
                    and not all(s.dtype == torch.float32 for s in g.slots)), reverse=True)
    return sum(sizes[:2])


def device_staging_bytes(groups: Iterable[Any], device: Any, param_home: Tier, *, partitioned: bool) -> int:
    """Host bytes a run on a device needs beside the optimizer's shards (none where compute
    runs in host memory): ``GRAD_COPIES`` buffers of the largest gradient copied out at once
    (``_staging``: a parameter's; with several ranks a group's reduced fp32 slice), and, with
    parameters on NVMe, a staging buffer for the largest group on its way to the device."""
    if host_compute(device):
        return 0
    groups = list(groups)
    copies = GRAD_COPIES * round_up(largest_grad_copy(groups, partitioned=partitioned), PAGE_SIZE)
    stage = max((g.nbytes for g in groups if not g.resident), default=0) if param_home is Tier.NVME else 0
    return copies + round_up(stage, PAGE_SIZE)


def largest_grad_copy(groups: Iterable[Any], *, partitioned: bool) -> int:
    largest = 0
    for g in groups:
        for s in g.slots:
            largest = max(largest, s.nbytes)
        if partitioned and g.slots:
            largest = max(largest, g.nbytes // min(s.dtype.itemsize for s in g.slots) * 4)
    return largest


def grad_room(items: list[Item], grad_tier: str) -> dict[int, int]:
    """Per store key: how many gradient bytes of the wrapped ``items`` may rest in host
    memory (``grad_tier``: "auto" as far as half of what the host budget leaves after the
    states already resting there and the staging allows, "host" all of them or a
    BudgetError, "nvme" none)."""
    room: dict[int, int] = {}
    wrapped = [it for it in items if it.owner is not None]
    for p in {it.placement.key: it.placement for it in wrapped}.values():
        if p.home is Tier.HOST or grad_tier == "nvme":
            continue
        need = 4 * sum(_padded(it) for it in wrapped if it.placement.key == p.key)
        free = p.host_budget - p.params - p.resting - p.write_back - p.param_staging - p.device_staging
        if grad_tier == "host":
            if need > free // 2:
                raise BudgetError(
                    f"grad_tier='host' keeps {format_size(need)} of fp32 gradients in host memory, more than "
                    f"half of the {format_size(max(free, 0))} that host_budget ({format_size(p.host_budget)}) "
                    "leaves after the parameter staging: raise host_budget or use grad_tier='auto'")
            room[p.key] = need
        else:
            room[p.key] = min(need, max(0, free // 2))
    return room


def _padded(item: Item) -> int:
    """Elements of ``item`` in its shards' rows: coded shards start each segment a block
    and end on one (``_layout.cut``)."""
    n = item.stop - item.start
    if coded(int(item.master) + item.rows, item.master, item.fmt, item.master_fmt):
        return n + 2 * BLOCK
    return n


def _pages(nbytes: int) -> int:
    """Host bytes a pool buffer of ``nbytes`` takes: whole pages (a 256-byte norm's copy takes 4 KiB)."""
    return round_up(nbytes, PAGE_SIZE) if nbytes else 0


def in_flight_bytes(shard: Shard, param_home: Tier | None) -> int:
    """Host pool bytes ``shard`` holds while it is read, updated and written: its rows and
    gradient, the groups it updates in host copies, and (coded rows) the fp32 scratch its
    update decodes into, each a buffer of whole pages."""
    reads = 0
    if shard.home is not Tier.HOST:
        reads = _pages(shard.state_bytes) + (_pages(shard.grad_bytes) if shard.grad_home is not Tier.HOST else 0)
    return reads + sum(_pages(n) for n in shard.group_copy_sizes(param_home)) + _pages(shard.scratch_bytes)


def resting_bytes(shard: Shard) -> int:
    """Host pool bytes ``shard`` keeps between steps (``Shard.host_resting_bytes`` in whole pages)."""
    states = _pages(shard.state_bytes) if shard.home is Tier.HOST else 0
    return states + (_pages(shard.grad_bytes) if shard.grad_home is Tier.HOST else 0)


def largest_in_flight(shards: Iterable[Shard], param_home: Tier | None) -> int:
    """Host bytes of the largest of ``shards`` in flight (``in_flight_bytes``)."""
    return max((in_flight_bytes(s, param_home) for s in shards), default=0)


def checkpoint_load_bytes(shard: Shard) -> int:
    """Host pool bytes a checkpoint load takes for ``shard`` where its rows are coded (the
    update's decode buffer is given back meanwhile): one buffer for the fp32 rows and the
    saved pieces read beside them, a page of alignment at each end, and for rows at home on
    NVMe the staging of their put (``checkpoint._optim_state``'s shard item)."""
    if not shard.packed:
        return 0
    read = _pages(round_up(shard.scratch_bytes, PAGE_SIZE) + shard.state_bytes + 2 * PAGE_SIZE)
    return read + (_pages(shard.state_bytes) if shard.home is not Tier.HOST else 0)


def backward_accumulators(shards: Iterable[Shard]) -> int:
    """Host pool bytes a backward takes for gradients summed on their way to NVMe: the
    accumulators open at once (a shard stays open until all of its parameters have
    reported; ``SHARDS_IN_FLIGHT`` of the largest, as many as were seen open together where
    autograd's order departs from the layout's) and the staging of one for its put."""
    largest = max((_pages(s.grad_bytes) for s in shards if s.wrapped and s.grad_home is not Tier.HOST), default=0)
    return (SHARDS_IN_FLIGHT + 1) * largest


def host_needs(shards: list[Shard], placements: dict[int, Placement]) -> dict[int, list[tuple[int, str]]]:
    """Per store key: the host pool bytes the optimizer's step needs there, in parts: the
    wrapped model's parameters at home there, the states and gradients resting in host
    memory, the largest shard in flight (or the backward's gradient accumulators), the
    write-back staging and compute's transfers on a device."""
    by_store: dict[int, list[Shard]] = defaultdict(list)
    for s in shards:
        by_store[id(s.store)].append(s)
    needs = {}
    for key, group in by_store.items():
        p = placements[key]
        wrapped = any(s.wrapped for s in group)
        needs[key] = [(p.params if wrapped else 0, "of parameters at home in host memory"),
                      (sum(resting_bytes(s) for s in group), "resting in host memory"),
                      (max(largest_in_flight(group, p.param_home), backward_accumulators(group),
                           max(map(checkpoint_load_bytes, group))),
                       "for one shard in flight (with the parameter groups it updates in place), the "
                       "backward's gradient accumulators, or a checkpoint load of coded rows"),
                      (p.write_back if wrapped else 0, "to write back a parameter group"),
                      (p.device_staging if wrapped else 0,
                       "to copy gradients and a parameter group between host and device")]
    return needs


def check_host_budget(shards: list[Shard], placements: dict[int, Placement]) -> dict[int, int]:
    """Per store: what the step needs in host memory (``host_needs``) must fit its host budget. Returns, per store key,
    what the budget leaves beyond them (the pool's ``limit_slack``)."""
    slack = {}
    for key, parts in host_needs(shards, placements).items():
        p = placements[key]
        need = sum(n for n, _ in parts)
        slack[key] = p.host_budget - need
        if need <= p.host_budget:
            continue
        group = [s for s in shards if id(s.store) == key]
        fixes = ["raise host_budget"]
        if any(s.home is Tier.HOST for s in group):
            fixes.append("set optimizer_tier='nvme'")
        fixes.append("pass a smaller shard_size")
        if any(s.grad_home is Tier.HOST and s.home is not Tier.HOST for s in group):
            fixes.append("set grad_tier='nvme'")
        budget, needed = format_apart(p.host_budget, need)
        error = BudgetError(
            f"the optimizer states need {needed} of host memory ("
            + ", ".join(f"{format_size(n)} {what}" for n, what in parts if n)
            + f") but host_budget is {budget}: " + ", ".join(fixes[:-1])
            + f" or {fixes[-1]}")
        error.short = {key: need - p.host_budget}
        raise error
    return slack


def cut_to_fit(cut_all: Callable[[dict[int, int], int | None, bool], list[Shard]], room: dict[int, int],
               grad_tier: str, check: Callable[[list[Shard]], Any], *, sized: bool) -> list[Shard]:
    """``cut_all(room, cap, split)``'s shards, passed by ``check`` (``check_host_budget``).
    Where they do not fit: with grad_tier "auto", fewer gradients are kept in host memory
    (``room``, per store key), down to none; then, unless the caller gave the shard size
    (``sized``), shards are cut smaller (``cap`` elements, halved each try down to
    ``MIN_SHARD``): a smaller shard touches fewer parameter groups updated in host copies.
    Before each cut smaller, shards are cut at those groups' edges too (``split``): one that
    spans two holds both in flight, and where the cut falls differs with the cap, so without
    it a larger budget could be refused where a smaller one fit. Only then does the refusal
    stand."""
    cap, kept, split = None, dict(room), False
    while True:
        shards = cut_all(room, cap, split)
        try:
            check(shards)
            return shards
        except BudgetError as err:
            short = getattr(err, "short", {})
            if grad_tier == "auto" and any(room.get(k) for k in short):
                # (a gradient sent to NVMe is read back in flight: a page more per try, at least)
                room = {k: max(0, n - max(short.get(k, 0), PAGE_SIZE)) if k in short else n for k, n in room.items()}
                continue
            if not split:  # (the same cap, cut at the groups' edges: fewer, larger shards than a smaller cap)
                room, split = dict(kept), True
                continue
            largest = max((s.numel for s in shards if id(s.store) in short), default=0)
            if sized or largest <= MIN_SHARD:
                raise
            cap, room = max(MIN_SHARD, largest // 2), dict(kept)  # (smaller shards may leave room for them again)


def check_machine(shards: list[Shard]) -> None:
    """Refuse, before allocating them, states that this machine's free RAM or disk cannot
    hold (offload.plan's checks, for these shards)."""
    resting = sum(s.host_resting_bytes for s in shards)
    if resting:
        check_ram(resting, "the optimizer states in host memory",
                  "set optimizer_tier='nvme' (OffloadConfig) or free memory")
    by_path: dict[str, int] = defaultdict(int)
    for s in shards:
        if s.nvme_bytes:
            by_path[s.store.tiers[Tier.NVME].files.path] += s.nvme_bytes
    moved: dict[int, tuple[Any, int]] = {}  # groups read in place that the first step copies to swap
    for s in shards:
        for seg in s.segments if s.wrapped else ():
            owner = seg.owner
            if owner.manager is not None and id(owner.group) not in moved and owner.manager.store.in_place(owner.group.key):
                moved[id(owner.group)] = (owner.manager.store, owner.group.nbytes)
    copies: dict[str, int] = defaultdict(int)
    for store, nbytes in moved.values():
        copies[store.tiers[Tier.NVME].files.path] += nbytes
    for path in by_path.keys() | copies.keys():
        what = [w for w, n in (("the optimizer states on NVMe", by_path[path]),
                               ("the parameters its first step copies out of the checkpoint", copies[path])) if n]
        fixes = ["free space there", "point nvme_path at a larger disk"]
        fixes += ["set optimizer_tier='host'"] if by_path[path] else []
        fixes += ["train fewer parameters (the checkpoint is never written: what the optimizer updates needs a "
                  "swap file)"] if copies[path] else []
        check_disk(path, by_path[path] + copies[path], " and ".join(what), ", ".join(fixes[:-1]) + ", or " + fixes[-1])
    for store in {id(s.store): s.store for s in shards if s.home is Tier.NVME}.values():
        tier = store.tiers[Tier.NVME]
        limit = getattr(tier, "cache_limit", None)
        total = tier.used_bytes + sum(s.nvme_bytes for s in shards if s.store is store)
        if limit is not None and total > limit:
            log.warning("offload: the optimizer states take the mmap NVMe tier at %s to %s, beyond its "
                        "page-cache limit (host_budget %s): they will be read back through the page cache at "
                        "cold-read speed each step; OffloadConfig(io_backend='direct') reads them with O_DIRECT",
                        tier.files.path, format_size(total), format_size(limit))


def plan_rows(groups: list[Any], config: Any, rows: tuple[str, ...], *, param_staging: int,
              partitioned: bool = False, moments: str | StateFormat = "fp32",
              master_format: str | StateFormat = "fp32") -> list[PlanRow]:
    """The optimizer's rows of ``offload.plan``: an offload optimizer keeping state ``rows``
    (``_rules.state_rows``, stored as ``moments`` says) over every parameter of ``groups``
    (this rank's slices, with ``partitioned``), laid out as the optimizer lays them out.
    Raises the optimizer's BudgetError where it would refuse."""
    fmt, master_fmt = StateFormat.parse(moments), StateFormat.parse_master(master_format)
    param_home = Tier.parse(config.param_tier)
    home = Tier.parse(config.optimizer_tier)
    placement = Placement(None, id(None), home, config.host_budget, write_back_bytes(groups, param_home),
                          param_staging if param_home is Tier.NVME else 0, param_home=param_home,
                          device_staging=device_staging_bytes(groups, config.torch_device, param_home,
                                                              partitioned=partitioned),
                          params=params_at_home(groups, param_home))
    cpu = host_compute(config.torch_device)
    items = []
    for group in groups:
        for slot in group.slots:
            owner = Owner(None, group, slot)
            master = wrapped_mode(owner, param_home, cpu) is MasterMode.ROW
            items.append(Item(slot.param, 0, owner, len(rows), master, placement, slot.first,
                              slot.first + slot.count, fmt=fmt, names=tuple(rows), master_fmt=master_fmt))
            if master:
                check_master_format(master_fmt, slot.dtype, tuple(slot.param.shape))
    if not items:
        return []
    # (the optimizer would refuse: so does the plan)
    slack: dict[int, int] = {}
    shards = cut_to_fit(lambda room, cap, split: cut(items, first_index=0, shard_size=cap, grad_room=room,
                                                     split_groups=split),
                        grad_room(items, "auto"), "auto",
                        lambda s: slack.update(check_host_budget(s, {placement.key: placement})), sized=False)
    masters = sum(s.master_bytes for s in shards)
    params = sum(seg.length for s in shards for seg in s.segments)
    moment_bytes = sum(s.state_bytes for s in shards) - masters
    out = [PlanRow(f"optimizer: {', '.join(rows) or 'no states'}", home.value, moment_bytes,
                   _moments_note(fmt, moment_bytes / max(params, 1), home))]
    if masters:
        per = masters / max(sum(s.numel for s in shards if s.master), 1)
        out.append(PlanRow("optimizer: master weights", home.value, masters,
                           ("bf16 (rounded stochastically)" if master_fmt is StateFormat.BF16 else "fp32")
                           + " copy of the parameters that are not fp32 where they rest"
                           + (f"; {2 * per:.0f} bytes per parameter moved per step" if home is Tier.NVME else "")))
    for tier in (Tier.HOST, Tier.NVME):
        grads = sum(s.grad_bytes for s in shards if s.grad_home is tier)
        if grads:
            kept = tier is Tier.HOST and home is not Tier.HOST
            out.append(PlanRow("optimizer: gradient accumulators", tier.value, grads,
                               "fp32, summed over backward passes"
                               + ("; kept in host memory (grad_tier='auto')" if kept else "")
                               + ("; 8 bytes per parameter moved per step" if tier is Tier.NVME else "")))
    scratch = max((s.scratch_bytes for s in shards), default=0)
    if scratch:
        out.append(PlanRow("optimizer: decode scratch", "host", scratch,
                           "the coded rows of one shard as fp32 while it is updated; held"))
    compiling = compile_bytes() if fmt is StateFormat.INT8 else 0
    if compiling:
        out.append(PlanRow("optimizer: compiling the 8-bit coding", "host", compiling,
                           "torch.compile's modules and caches, once per process, beside host_budget; "
                           "OFFLOAD_COMPILE_CODES=0 codes eagerly without them", pooled=False))
    flight = {id(s): in_flight_bytes(s, param_home) - _pages(s.scratch_bytes) for s in shards}
    flying = sorted(shards, key=lambda s: flight[id(s)], reverse=True)[:SHARDS_IN_FLIGHT]
    if home is Tier.NVME or any(s.group_copy_bytes(param_home) for s in shards):
        out.append(PlanRow("optimizer: shards in flight", "host",
                           min(config.host_budget, sum(flight[id(s)] for s in flying)),
                           "read ahead, update, write back; within host_budget"))
    for nbytes, item, note in ((placement.write_back, "optimizer: write-back staging",
                                "the two largest parameter groups assembled from master rows, written home"),
                               (placement.device_staging, "optimizer: device staging",
                                "gradients and parameter groups copied between host and device")):
        if nbytes:
            out.append(PlanRow(item, "host", nbytes, note))
    # the backward reads the next update's rows into the pool's room (_ahead); one process only
    if home is Tier.NVME and not partitioned:
        # (within the room the budget leaves beyond the step's needs: no more is read)
        ahead = min(sum(s.state_bytes for s in shards) - sum(s.state_bytes for s in flying),
                    max(0, slack.get(placement.key, 0)))
        if ahead > 0:
            out.append(PlanRow("optimizer: states read in the backward", "host", ahead,
                               "the next update's rows, read while the backward leaves the disk idle, "
                               "as far as host_budget's room goes"))
    return out


def _moments_note(fmt: StateFormat, per_param: float, home: Tier) -> str:
    what = {StateFormat.FP32: "fp32", StateFormat.BF16: "bf16",
            StateFormat.INT8: "8-bit codes with a scale per 256"}[fmt]
    note = f"{what}: {per_param:.2f} bytes per parameter"
    if home is Tier.NVME:
        note += f", {2 * per_param:.2f} moved per step (read and written)"
    return note
