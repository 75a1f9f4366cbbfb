"""``offload.plan``: the memory plan of wrapping a model and training it with an offload
optimizer, computed from the same sizing the runtime uses (``offload.params.device_layout``
for the device, ``offload.optim.plan_rows`` for the optimizer), allocating nothing."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch.distributed as dist

from torch import nn

from ._activation_estimate import estimate_activations
from ._plan import MemoryPlan, host_param_bytes, plan_groups
from .config import OffloadConfig
from .distributed import Partition
from .optim import plan_rows, state_rows
from .io import BudgetError
from .params import CheckpointReader, InPlaceLayout, check_partitioned, device_layout, slice_groups

__all__ = ["plan"]


def plan(model: nn.Module, config: OffloadConfig, *, optimizer: str | None = "adamw",
         batch: Mapping[str, Any] | None = None, moments: str = "fp32", master: str = "fp32",
         checkpoint: str | os.PathLike | None = None) -> MemoryPlan:
    """The memory plan of ``offload.wrap(model, config)`` followed by an offloaded optimizer
    of kind ``optimizer`` (``"adamw"``, ``"adam"``, ``"sgd"`` with momentum, or ``None``)
    with its default settings, its moments stored as ``moments`` says (``"fp32"``,
    ``"bf16"``, ``"int8"``: the optimizers' ``moments=``) and its master rows as ``master``
    says (``"fp32"``, ``"bf16"``). Allocates nothing; the model may
    be on the meta device.

    ``batch``: the keyword arguments of one training forward (``model(**batch)``), tensors
    of the real shapes and dtypes on any device ("meta" allocates nothing). The plan then
    counts what a training step allocates beside the tiers (the tensors autograd saves,
    from a forward on the meta device; the largest gradient; the memory malloc keeps) and
    ``predicted_rss`` is the peak RSS of the run. Where nothing trains (no parameter requires
    grad) it counts what a forward without grad holds at once instead (inference).

    ``checkpoint``: the safetensors checkpoint ``wrap`` will be given; the plan then says
    which groups are read in place from it (``read_in_place``: no disk until written) and
    which are copied.

    With several ranks (``config.world_size``, or an initialised torch.distributed) it is
    the plan of one rank: its slices of every group and the whole groups gathered on the
    device while in use; of the ranks' plans (they differ by padding, which can cut another
    rank's shards larger), the first that does not fit, else the one that needs the most
    host memory."""
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    kind = None if optimizer is None else str(optimizer).lower()
    state = None if kind is None else state_rows(kind)  # (refuses an unknown kind)
    world = config.world_size
    if world is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    reader = None if checkpoint is None else CheckpointReader(os.fspath(checkpoint), model)
    placing = InPlaceLayout(reader, config, partitioned=world > 1)
    layout = device_layout(model, config, partitioned=world > 1, check=False, place=placing)
    if config.nvme_path is not None and "{" in config.nvme_path:  # rank 0's directory
        config = config.replace(nvme_path=config.nvme_path.format(rank=0, local_rank=0))
    rows = None if state is None else (lambda gs, cfg, staging: plan_rows(gs, cfg, state, param_staging=staging,
                                                                           partitioned=world > 1, moments=moments,
                                                                           master_format=master))
    activations = None if batch is None else estimate_activations(model, batch, config.dtype, config.torch_device.type)
    credit, largest = host_param_bytes(model) // world, _largest_gradient(model, config)
    plans = []
    for rank in range(world):  # (each rank's slices: the last one's padding can cut larger shards)
        groups, refusal = layout.groups, layout.refusal
        if world > 1:
            groups = slice_groups(groups, Partition(None, rank, world, 0, "gloo"))
            try:  # (wrap's rule for a rank: a gathered group beside its slices)
                check_partitioned(layout.groups, config, groups)
            except BudgetError as err:
                refusal = err
        plans.append(plan_groups(groups, config, ram_credit=credit, world=world,
                                 room=layout.room(config.device_budget), optimizer=rows, activations=activations,
                                 grad_bytes=largest, in_place=placing.choice, refusal=refusal))
    failing = [p for p in plans if not p.fits]
    return failing[0] if failing else max(plans, key=lambda p: p.bytes_on("host"))  # (max: the first of equals)


def _largest_gradient(model: nn.Module, config: OffloadConfig) -> int:
    """Bytes of the largest gradient autograd produces (a trained parameter's, in the
    compute dtype): it exists whole before the optimizer takes it."""
    sizes = [p.numel() * (config.dtype or p.dtype).itemsize for p in model.parameters() if p.requires_grad]
    return max(sizes, default=0)
