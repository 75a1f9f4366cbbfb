"""The memory plan: what a wrapped model (and its optimizer) will hold on each tier, checked
against what the machine has, before anything is allocated.

    p = offload.plan(model, cfg, optimizer="adamw")
    str(p)            # a table: item, tier, bytes, how it was counted (wrap logs it at INFO)
    p.check()         # raises MemoryPlanError with the numbers and a fix when it cannot fit

``offload.wrap`` computes the plan for the parameters, logs it at INFO and refuses (before
creating the store, its buffers or its files) when it cannot fit; the offloaded optimizers
check their states the same way before allocating them.

Note: the resident set. ``predicted_rss`` is the plan's promise about the process's RSS
(what the OOM killer reads): the baseline (RSS now, less the model's parameters that
wrapping frees), the host rows, the device rows on a CPU device, and, when ``offload.plan``
is given a ``batch``, what torch allocates beside them on a CPU device: the tensors autograd
saves (estimated on the meta device, ``_activation_estimate``; for a model that trains
nothing, what its forward holds at once), the largest gradient autograd hands over, and the
freed memory glibc's malloc keeps (``host_allocator``, ``_memory``). On CUDA those count
against the device's free memory instead, and the host RSS gets an allowance for what the
CUDA driver takes as torch loads its kernels at first use (``CUDA_KERNEL_HOST_BYTES``).

Note: what is counted. Budgets are upper bounds; the plan counts what the run will use up
to them: the device budget or less if the whole model is smaller; host staging for NVMe
reads (the prefetch window and the largest group), and everything that rests in host
memory. Parameters that already sit in host memory (a model built on the CPU) are freed
group by group as they are moved into the tiers, so they are credited against the RAM
needed. The checks use ``psutil.virtual_memory().available``, ``torch.cuda.mem_get_info``
and the free space of ``nvme_path``'s file system.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil
import torch
from torch import nn

from ._activation_estimate import ActivationEstimate
from ._memory import CUDA_KERNEL_HOST_BYTES, heap_overhead_factor, resolve_allocator, rss_bytes
from ._os import nearest_existing_dir
from ._plan_activations import activation_warnings, ACTIVATION_ITEM, plan_activations
from ._resolve import choose_io_backend
from ._units import format_size
from .config import OffloadConfig
from .io import PAGE_SIZE, BudgetError, round_up

__all__ = ["MemoryPlan", "MemoryPlanError", "PlanRow", "plan_groups", "param_staging", "host_param_bytes",
           "free_disk_bytes", "check_ram", "check_disk"]

log = logging.getLogger(__name__)


class MemoryPlanError(BudgetError):
    """The plan does not fit this machine or its settings; the message has the numbers and the fix."""


@dataclass
class PlanRow:
    item: str
    tier: str  # "device", "host", "nvme"
    nbytes: int
    note: str = ""
    pooled: bool = True  # held within the tier's budget (False: beside it, as the process's own memory)


@dataclass
class MemoryPlan:
    config: OffloadConfig
    rows: list[PlanRow] = field(default_factory=list)
    ram_need: int = 0          # host RAM: host rows, and device rows when the device is the CPU
    ram_credit: int = 0        # parameters now in host memory that wrapping frees
    ram_available: int = 0
    device_need: int = 0       # CUDA memory (0 on the CPU)
    device_free: int | None = None
    disk_need: int = 0
    disk_free: int | None = None
    pinned: int = 0
    memlock_limit: int | None = None
    world: int = 1  # ranks the parameters are partitioned over: the plan is one rank's
    baseline_rss: int = 0      # RSS now, less ram_credit: what the process holds besides the run
    activations: ActivationEstimate | None = None  # None: no batch was given
    activations_kept: int | None = None  # saved bytes left in compute memory with activation_tier set
    grad_bytes: int = 0        # the largest gradient autograd hands over (compute dtype)
    heap_overhead: int = 0     # freed memory malloc is expected to keep (host_allocator="system")
    mapped_bytes: int = 0      # swap-file pages the mmap backend may keep mapped (up to host_budget)
    cuda_kernels: int = 0      # host memory CUDA's kernels take as they load at first use (an allowance)
    allocator: str = "system"  # host_allocator as it applies to this run
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def check(self) -> None:
        """Raise :class:`MemoryPlanError` listing every problem, each with its fix."""
        if self.problems:
            raise MemoryPlanError("offload memory plan does not fit this machine or its settings:\n  - "
                                  + "\n  - ".join(self.problems) + "\n" + self._render(problems=False))

    @property
    def transient_bytes(self) -> int:
        """What torch allocates on the compute device beside the tiers at the peak of a
        training step (or of an inference forward): saved tensors, the largest gradient,
        malloc's kept memory (0 without an activation estimate)."""
        if self.activations is None or self.activations.error is not None:
            return 0
        return self.activation_bytes + self.grad_bytes + self.heap_overhead

    @property
    def activation_bytes(self) -> int:
        """Saved tensors in compute memory at the peak (what activation offload leaves there);
        for inference, the forward's peak (nothing is saved for activation offload to move)."""
        if self.activations is None or self.activations.error is not None:
            return 0
        if self.activations_kept is None or self.activations.inference:
            return self.activations.peak_bytes
        return self.activations_kept

    @property
    def disk_claim(self) -> int:
        """The least the swap files take on disk: ``disk_need`` in whole files of
        ``file_size`` (claimed with fallocate as they are opened; an extent never spans two
        files, so the packing can need one more)."""
        size = self.config.file_size
        return -(-self.disk_need // size) * size if self.disk_need else 0

    @property
    def predicted_rss(self) -> int:
        """The process's peak RSS this plan promises (see the module's note)."""
        cuda = self.config.torch_device.type == "cuda"
        return (self.baseline_rss + self.ram_need + self.mapped_bytes + self.cuda_kernels
                + (0 if cuda else self.transient_bytes))

    def bytes_on(self, tier: str) -> int:
        return sum(r.nbytes for r in self.rows if r.tier == tier)

    def __str__(self) -> str:
        return self._render(problems=True)

    def _render(self, *, problems: bool) -> str:
        c = self.config
        head = (f"offload memory plan: device {c.device}, param_tier {c.param_tier}, optimizer_tier "
                f"{c.optimizer_tier}, device_budget {format_size(c.device_budget)}, host_budget "
                f"{format_size(c.host_budget)}" + (f"; per rank, {self.world} ranks" if self.world > 1 else ""))
        table = [("item", "tier", "bytes", "counted as")] + [
            (r.item, r.tier, format_size(r.nbytes), r.note) for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        lines = [head] + ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                          for row in table]
        ram = (f"host RAM: needs {format_size(self.ram_need)} (host rows within host_budget"
               + ("" if self.config.torch_device.type == "cuda" else ", device rows within device_budget")
               + ")"
               + (f" less {format_size(self.ram_credit)} of parameters freed as they move"
                  if self.ram_credit else "")
               + f", {format_size(self.ram_available)} available")
        lines.append("  " + ram)
        lines.append("  " + self._rss_line())
        if self.device_free is not None:
            lines.append(f"  {c.device}: needs {format_size(self.device_need)}, {format_size(self.device_free)} free")
        if self.disk_need:
            free = "unknown" if self.disk_free is None else format_size(self.disk_free)
            lines.append(f"  disk at {c.nvme_path}: needs {format_size(self.disk_need)} (claims "
                         f"{format_size(self.disk_claim)}, whole files of file_size), {free} free")
        if self.pinned:
            limit = "unlimited" if self.memlock_limit is None else format_size(self.memlock_limit)
            lines.append(f"  pinned host memory: {format_size(self.pinned)} (ulimit -l: {limit})")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        for problem in self.problems if problems else []:
            lines.append(f"  does not fit: {problem}")
        return "\n".join(lines)

    def _rss_line(self) -> str:
        cuda = self.config.torch_device.type == "cuda"
        parts = [f"baseline {format_size(self.baseline_rss)}", f"host rows {format_size(self.ram_need)}"
                 + ("" if cuda else " (with the device rows)")]
        if self.mapped_bytes:
            parts.append(f"mapped swap-file pages {format_size(self.mapped_bytes)} (io_backend "
                         f"'{self.config.io_backend}')")
        if self.cuda_kernels:
            parts.append(f"CUDA kernels loaded at first use {format_size(self.cuda_kernels)} (an allowance)")
        act = self.activations
        if act is None:
            tail = "; activations not counted (give offload.plan a batch=)"
        elif act.error is not None:
            tail = f"; activations not counted: the forward does not run on the meta device ({act.error})"
        else:
            terms = ", ".join(f"{what} {format_size(n)}" for n, what in (
                (self.activation_bytes, "the forward's peak (inference)" if act.inference
                 else "activations" if act.step_bytes is None or self.activations_kept is not None
                 else "activations and gradients at the step's peak"),
                (self.grad_bytes, "largest gradient"),
                (self.heap_overhead, f"malloc's kept memory (host_allocator '{self.allocator}')")) if n)
            if cuda:
                tail = "; on the device, " + (terms or "torch's tensors 0 B")
            else:  # (the terms break torch's tensors down; all 0, there is nothing to break down)
                parts.append(f"torch's tensors {format_size(self.transient_bytes)}")
                tail = f"; {terms}" if terms else ""
        return f"RSS: predicted peak {format_size(self.predicted_rss)} = " + " + ".join(parts) + tail


def plan_groups(groups: list, config: OffloadConfig, *, ram_credit: int = 0, world: int = 1,
                room: int | None = None, optimizer: Callable[[list, OffloadConfig, int], list] | None = None,
                activations: ActivationEstimate | None = None, grad_bytes: int = 0,
                in_place: Any = None, refusal: BudgetError | None = None) -> MemoryPlan:
    """The plan for parameter groups already built (``wrap`` calls this); with ``world``
    ranks, ``groups`` are this rank's slices. ``room``: what the device budget leaves for
    the prefetch window (offload.params.device_layout). ``optimizer(groups, config,
    param_staging)``: the optimizer's rows (``offload.optim.plan_rows``), given the host
    bytes the parameter reads stage through. ``activations``: the estimate for a batch
    (``offload.plan(batch=...)``), ``grad_bytes`` the largest gradient autograd hands over.
    ``in_place``: the groups read where a checkpoint holds them (an
    ``offload.params.InPlaceChoice``), which take no disk until written. ``refusal``: what
    ``wrap`` refuses of the groups' layout (``DeviceLayout.refusal``), a problem of the plan."""
    cuda = config.torch_device.type == "cuda"
    if cuda and torch.cuda.is_available():
        torch.cuda.init()  # (the CUDA context's libraries are resident from here: part of the baseline)
    p = MemoryPlan(config=config, ram_credit=ram_credit, world=world, activations=activations,
                   grad_bytes=grad_bytes if activations is not None else 0,
                   baseline_rss=max(0, rss_bytes() - ram_credit),
                   allocator=resolve_allocator(config.host_allocator, config.torch_device.type),
                   cuda_kernels=CUDA_KERNEL_HOST_BYTES if cuda else 0)
    if refusal is not None:
        p.problems.append(f"parameters: {refusal}")
    offloaded = plan_activations(config, activations)
    p.activations_kept = offloaded.kept_bytes
    if activations is not None and activations.step_bytes is not None and p.activations_kept is None:
        p.grad_bytes = 0  # (the step's peak, run through its backward on meta, holds each gradient as it is made)
    if activations is not None and activations.error is None and not cuda:  # (on CUDA they are on the device)
        p.heap_overhead = int(heap_overhead_factor(p.allocator) * p.activation_bytes)
    if activations is not None:
        p.warnings.extend(activation_warnings(activations, config))
    resident = sum(g.nbytes for g in groups if g.resident)
    streamed = [g.nbytes for g in groups if not g.resident]
    largest = max(streamed, default=0)
    median = sorted(streamed)[len(streamed) // 2] if streamed else 0
    if room is None:
        room = max(0, config.device_budget - largest)
    window = config.prefetch_limit(room, median) if streamed else 0
    staging = param_staging(config, window, largest)

    # -- parameters ----------------------------------------------------------------------
    if resident:
        p.rows.append(PlanRow("parameters, resident", "device", resident,
                              "small modules' parameters" if config.param_tier != "device" else "all of them"))
    whole = [g.whole.nbytes for g in groups if g.whole is not None]  # several ranks: slices
    if streamed:
        home = config.param_tier
        adopted = in_place.buffer_bytes if in_place is not None else 0
        n_adopted = len(in_place.adopted) if in_place is not None else 0
        if adopted:
            p.rows.append(PlanRow("parameters, read in place", "checkpoint", in_place.in_place_bytes,
                                  f"{len(in_place.adopted)} groups in the checkpoint's files, read as whole 4 KiB "
                                  f"blocks ({format_size(adopted)}); none copied"))
            if optimizer is not None and in_place.trainable_bytes:
                p.rows.append(PlanRow("parameters copied on first write", "nvme", in_place.trainable_bytes,
                                      "the trainable groups leave the checkpoint at the optimizer's first step"))
        if sum(streamed) > adopted:
            copied = "".join(f"; {len(gs)} copied from the checkpoint at wrap ({format_size(sum(g.nbytes for g in gs))}"
                             f": {reason})" for reason, gs in (in_place.copied if in_place is not None else {}).items())
            p.rows.append(PlanRow("parameters, streamed" if not whole else "parameters, this rank's slices", home,
                                  sum(streamed) - adopted, f"{len(streamed) - n_adopted} groups, largest "
                                  f"{format_size(largest)}{copied}"))
        if whole:
            working = min(config.device_budget - (sum(streamed) if home == "device" else largest), sum(whole))
            p.rows.append(PlanRow("parameters gathered from all ranks", "device", working,
                                  f"whole groups while in use, largest {format_size(max(whole))}; up to the "
                                  "device budget"))
        if home != "device" or not whole:
            working = min(config.device_budget - resident, sum(streamed))
            p.rows.append(PlanRow("parameters on the device in use", "device", working,
                                  f"up to the device budget: largest group + prefetch {format_size(window)} + cache"))
        if home == "nvme":
            p.rows.append(PlanRow("host staging for parameter reads", "host", staging,
                                  "prefetch window + largest group, within host_budget"))
            if round_up(largest, PAGE_SIZE) > config.host_budget:  # (wrap's first put of it would refuse)
                p.problems.append(f"parameters: the largest group, {format_size(largest)}, moves between NVMe and "
                                  f"the device through host memory, but host_budget is "
                                  f"{format_size(config.host_budget)}: raise host_budget above "
                                  f"{format_size(round_up(largest, PAGE_SIZE))}, or make groups smaller (group_bytes)")
    if optimizer is not None and groups:
        try:
            p.rows.extend(optimizer(groups, config, staging))
        except BudgetError as err:  # what the optimizer would refuse: a problem of the plan
            p.problems.append(f"optimizer: {err}")

    p.rows.extend(PlanRow(*row) for row in offloaded.rows)
    p.problems.extend(offloaded.problems)

    # -- needs -----------------------------------------------------------------------------
    # one host pool (host_budget) holds everything on the host tier, one device budget the rest;
    # offloaded activations have pools of their own (activation_host_budget, activation_prefetch)
    def own(tier: str) -> int:
        return sum(r.nbytes for r in p.rows if r.tier == tier and (r.item.startswith(ACTIVATION_ITEM) or not r.pooled))

    capped = {t: min(b, p.bytes_on(t) - own(t)) for t, b in (("host", config.host_budget),
                                                               ("device", config.device_budget))}
    host_rows, device_rows = capped["host"] + own("host"), capped["device"] + own("device")
    p.ram_need = host_rows + (0 if cuda else device_rows)
    p.device_need = device_rows + p.transient_bytes if cuda else 0
    p.disk_need = p.bytes_on("nvme")
    # the mmap backend keeps pages of the swap files mapped, up to host_budget, beside the
    # pool; "auto" chooses as wrap will (from the parameters' NVMe bytes: offload._resolve)
    if p.disk_need and config.nvme_path:
        params_on_nvme = sum(r.nbytes for r in p.rows if r.tier == "nvme" and r.item.startswith("parameters"))
        if choose_io_backend(config, params_on_nvme).backend == "mmap":
            p.mapped_bytes = min(p.disk_need, config.host_budget)
    p.pinned = host_rows if cuda else 0
    _check_machine(p, config, cuda, capped["host"])
    return p


# ---------------------------------------------------------------------------------------
def param_staging(config: OffloadConfig, window: int, largest: int) -> int:
    """Host bytes parameter reads from NVMe stage through: the prefetch window and the
    largest group, within host_budget (the room an optimizer leaves in the host pool)."""
    return min(config.host_budget, window + largest)


def free_disk_bytes(path: str) -> int | None:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    current = nearest_existing_dir(path)
    if current is None:
        return None
    try:
        return shutil.disk_usage(current).free
    except OSError:
        return None


def check_ram(need: int, what: str, fix: str, credit: int = 0) -> None:
    """Raise MemoryPlanError when ``need`` bytes of host RAM (less ``credit``) exceed what is
    available now."""
    available = psutil.virtual_memory().available
    if need - credit > available:
        raise MemoryPlanError(f"{what} need {format_size(need - credit)} of host RAM but "
                              f"{format_size(available)} is available: {fix}")


def check_disk(path: str, need: int, what: str, fix: str) -> None:
    free = free_disk_bytes(path)
    if free is not None and need > free:
        raise MemoryPlanError(f"{what} need {format_size(need)} on disk but {path!r} has "
                              f"{format_size(free)} free: {fix}")


def _check_machine(p: MemoryPlan, config: OffloadConfig, cuda: bool, host_pool: int) -> None:
    """``host_pool``: the host bytes host_budget caps (the pool's rows), for the fix it suggests."""
    p.ram_available = psutil.virtual_memory().available
    ram = p.ram_need - p.ram_credit + (p.cuda_kernels if cuda else p.transient_bytes)
    if ram > p.ram_available and not cuda and p.transient_bytes and ram - p.transient_bytes <= p.ram_available:
        # the budgets fit: the batch's tensors do not
        p.problems.append(f"host RAM: {format_size(ram)} needed, {format_size(p.ram_available)} available, of which "
                          f"torch's tensors for this batch take {format_size(p.transient_bytes)}: use a smaller "
                          "batch, or activation checkpointing (model.gradient_checkpointing_enable())")
    elif ram > p.ram_available:
        fixes = []
        if p.bytes_on("host") and config.param_tier == "host":
            fixes.append("param_tier='nvme'")
        if config.optimizer_tier == "host" and any(r.item.startswith("optimizer:") for r in p.rows):
            fixes.append("optimizer_tier='nvme'")
        limit = max(0, p.ram_available - (ram - host_pool))
        if config.param_tier != "host":
            fixes.append(f"host_budget<={format_size(limit)}")
        if not cuda:
            fixes.append("a smaller device_budget (on the CPU it is RAM too)")
            if p.transient_bytes:
                fixes.append("a smaller batch")
        p.problems.append(f"host RAM: {format_size(ram)} needed, {format_size(p.ram_available)} available: "
                          f"set {' or '.join(fixes) or 'smaller budgets'}")
    if cuda:
        free = None
        if not torch.cuda.is_available():  # planning here for a GPU machine: nothing to check against
            p.warnings.append(f"no CUDA device here: {config.device}'s free memory is not checked")
        else:
            try:
                free, _ = torch.cuda.mem_get_info(config.torch_device)
            except RuntimeError:
                pass
        p.device_free = free
        if free is not None and p.device_need > free:
            p.problems.append(f"{config.device}: {format_size(p.device_need)} needed, {format_size(free)} free: "
                              f"set device_budget<={format_size(free * 9 // 10)} or free device memory")
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        p.memlock_limit = None if soft == resource.RLIM_INFINITY else soft
        if p.memlock_limit is not None and p.pinned > p.memlock_limit and os.geteuid() != 0:
            p.warnings.append(f"{format_size(p.pinned)} of pinned host buffers exceed ulimit -l "
                              f"({format_size(p.memlock_limit)}); pinning may fail and fall back to slower "
                              "pageable copies: raise the limit (ulimit -l unlimited)")
    if p.disk_need and config.nvme_path:
        p.disk_free = free_disk_bytes(config.nvme_path)
        if p.disk_free is not None and p.disk_need > p.disk_free:
            p.problems.append(f"disk at {config.nvme_path}: {format_size(p.disk_need)} needed, "
                              f"{format_size(p.disk_free)} free: free space there, point nvme_path at a larger "
                              "disk, or keep a tier in memory (param_tier or optimizer_tier='host')")
        elif p.disk_free is not None and p.disk_claim > p.disk_free:  # (space is claimed a file at a time)
            p.problems.append(f"disk at {config.nvme_path}: swap space is claimed in files of file_size="
                              f"{format_size(config.file_size)}: {format_size(p.disk_claim)} for "
                              f"{format_size(p.disk_need)}, {format_size(p.disk_free)} free: set a smaller "
                              "file_size, or free space there")


def host_param_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters in host memory now (tied ones once): what wrapping
    frees as it moves them into the tiers."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
