"""The memory plan's rows for offloaded activations (``OffloadConfig.activation_tier``):
their buffers have budgets of their own, beside the parameters' pools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._activation_estimate import ActivationEstimate
from ._units import format_size
from .config import OffloadConfig

__all__ = ["ActivationPlan", "plan_activations", "activation_warnings", "ACTIVATION_ITEM"]

ACTIVATION_ITEM = "activations"  # the rows' item names start with this (their own budgets)


@dataclass(frozen=True)
class ActivationPlan:
    rows: list  # PlanRow-like tuples: (item, tier, nbytes, note)
    kept_bytes: int | None  # saved bytes left in compute memory at the peak (None: no estimate)
    problems: list[str]


def plan_activations(config: OffloadConfig, estimate: ActivationEstimate | None) -> ActivationPlan:
    """Where ``config`` puts a step's saved activations, given the ``estimate`` of a batch
    (None or failed: the buffers only). At the peak, compute memory holds the newest
    ``activation_budget`` bytes and the largest saved tensor with its gradient beside it."""
    if config.activation_tier is None:
        return ActivationPlan([], None, [])
    from .activations import chunk_bytes, host_pool_bytes

    rows, problems = [], []
    rows.append((f"{ACTIVATION_ITEM} read ahead", "device", config.activation_prefetch + chunk_bytes(config),
                 "activation_prefetch and one piece"))
    known = estimate is not None and estimate.error is None
    moved = max(0, estimate.saved_bytes - config.activation_budget) if known else None
    if config.activation_tier == "host":
        room = host_pool_bytes(config, config.torch_device.type == "cuda")
        held = config.activation_host_bytes() if moved is None else min(moved, room)
        rows.append((f"{ACTIVATION_ITEM} offloaded", "host", held, "at most activation_host_budget"))
        if moved is not None and moved > room:
            problems.append(f"activations: {format_size(moved)} saved beyond activation_budget do not fit "
                            f"activation_host_budget ({format_size(config.activation_host_bytes())}): raise "
                            "activation_host_budget or activation_budget, or use activation_tier='nvme'")
    else:
        rows.append((f"{ACTIVATION_ITEM} write buffers", "host", config.activation_host_bytes(),
                     "activation_host_budget: writes in flight (and copies out of the device)"))
        if moved is not None:
            rows.append((f"{ACTIVATION_ITEM} offloaded", "nvme", moved, "saved beyond activation_budget"))
    kept = None
    if known:
        kept = estimate.batch_bytes + min(estimate.saved_bytes, config.activation_budget) + 2 * estimate.largest_bytes
    return ActivationPlan(rows, kept, problems)


def activation_warnings(estimate: ActivationEstimate, config: OffloadConfig) -> list[str]:
    """What the plan's figure for torch's tensors leaves out or assumes, given ``estimate``."""
    out = []
    if config.torch_device.type != "cuda" and config.dtype in (torch.bfloat16, torch.float16):
        out.append("predicted_rss leaves out what torch's bf16/fp16 CPU kernels (oneDNN) cache beside the "
                   "tensors: measured 3-8% of the peak on dense models, growing each step on mixture-of-"
                   "experts ones as it does without offload (docs/memory.md); "
                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 keeps less")
    if estimate.values_assumed:
        out.append(f"the activation estimate took the {estimate.values_assumed} true-or-false value(s) the "
                   "forward read from tensors as true (the meta device holds no values): transformers reads "
                   "them to leave out the mask of a batch without padding or packed sequences; a batch "
                   "that has them holds its masks beside (the first step's log line measures it: "
                   "mem_heap_peak_bytes)")
    if estimate.error is not None:
        out.append("predicted_rss leaves out torch's tensors (activations, gradients): the forward does "
                   f"not run on the meta device ({estimate.error}); the first step's log line "
                   "(mem_heap_peak_bytes) measures them")
    return out
