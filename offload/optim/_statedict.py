"""An offload optimizer's state dict in torch's format: per parameter ``step``, the moment
buffers (full tensors in the parameter's shape, fp32) and, where a master row is kept,
``master_param``; torch's optimizers load it, and ours loads theirs."""

from __future__ import annotations

from typing import Callable

import psutil
import torch

from .._units import format_size
from ..io import BudgetError
from ._layout import Shard
from ._states import StateRows

__all__ = ["gather_state", "check_groups", "scatter_state", "masters_to_take"]


def gather_state(shards: list[Shard], states: StateRows, index: dict[int, int]) -> dict[int, dict]:
    """``state`` of the state dict: per parameter index (``index``: id(param) -> index)."""
    need = sum(len(states.names(s)) * sum(seg.length for seg in s.segments) * 4 for s in shards)
    available = psutil.virtual_memory().available
    if need > available:
        raise BudgetError(
            f"state_dict() of an offload optimizer copies every state into host memory: {format_size(need)} "
            f"of fp32 states, {format_size(available)} of RAM available. Save it with "
            "offload.save_checkpoint(path, model, optimizer), which streams a shard at a time (with HF "
            "Trainer: save_strategy='no' and offload.save_checkpoint in a callback or after train())")
    state: dict[int, dict] = {}
    for shard in shards:
        rows = states.read(shard)
        names = states.names(shard)
        for seg in shard.segments:
            if float(seg.step) == 0 and "momentum_buffer" not in names:
                continue
            entry = state.setdefault(index[id(seg.param)], {"step": seg.step.clone()})
            if float(seg.step) == 0:
                continue
            for r, name in enumerate(names):
                if name not in entry:
                    entry[name] = torch.zeros(seg.param.shape, dtype=torch.float32)
                entry[name].view(-1)[seg.start: seg.start + seg.length].copy_(
                    rows[r, seg.offset: seg.offset + seg.length])
    return state


def check_groups(param_groups: list[dict], saved_groups: list[dict], rows_for: Callable[[dict], tuple],
                 name: str) -> dict[int, torch.Tensor]:
    """Refuse a state dict whose groups do not match; the saved index -> parameter."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, this optimizer "
                         f"{len(param_groups)}")
    by_index = {}
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
        if rows_for(merged) != rows_for(group):  # the states it keeps would change
            keys = sorted(k for k in ("amsgrad", "momentum") if k in saved and bool(saved[k]) != bool(group[k]))
            raise ValueError(
                f"parameter group {i} of the state dict has {', '.join(f'{k}={saved[k]!r}' for k in keys)}, this "
                f"optimizer {', '.join(f'{k}={group[k]!r}' for k in keys)}: they keep different states. Build "
                f"the {name} with the state dict's settings")
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"parameter group {i} has {len(group['params'])} parameters, the state "
                             f"dict's has {len(saved['params'])}")
        by_index.update(zip(saved["params"], group["params"]))
    return by_index


def scatter_state(shards: list[Shard], states: StateRows, loaded: dict[int, dict]) -> None:
    """Write ``loaded`` (id(param) -> its saved state) into every shard's rows. A master
    the state dict lacks (torch's, for a model offload runs in bf16) stays what it is: the
    model's values, not their rounded copy."""
    for shard in shards:
        rows = torch.zeros(shard.rows, shard.numel, dtype=torch.float32)
        current = states.read(shard) if shard.master else None
        names = states.names(shard)
        for seg in shard.segments:
            entry = loaded.get(id(seg.param), {})
            # torch's SGD saves its momentum buffer and no step: a buffer means it has
            # stepped (step 0 would make the next update overwrite the buffer)
            stepped = any(entry.get(n) is not None for n in names if n != "master_param")
            seg.step.fill_(float(entry.get("step", 1 if stepped else 0)))
            for r, n in enumerate(names):
                if n == "master_param" and n not in entry:
                    source = states.current_values(seg) if seg.owner is None else \
                        current[0, seg.offset: seg.offset + seg.length]
                elif n in entry:
                    source = entry[n].reshape(-1)[seg.start: seg.start + seg.length]
                else:
                    continue
                rows[r, seg.offset: seg.offset + seg.length].copy_(source)
        states.write(shard, rows)


def reset_rows(shards: list[Shard], states: StateRows, wanted: set[int] | None) -> None:
    """Step 0 and zero moments for the parameters whose ids are in ``wanted`` (all when
    None); the master rows stay. Only the shards holding them are read and written, each
    as ``scatter_state`` writes it (the bytes between segments zero: coded rows then come
    out as a state dict without those parameters would load)."""
    for shard in shards:
        if not any(wanted is None or id(seg.param) in wanted for seg in shard.segments):
            continue
        names = states.names(shard)
        old = states.read(shard)
        rows = torch.zeros_like(old)
        for seg in shard.segments:
            part = slice(seg.offset, seg.offset + seg.length)
            if wanted is None or id(seg.param) in wanted:
                seg.step.fill_(0.0)
                if shard.master:
                    rows[names.index("master_param"), part] = old[names.index("master_param"), part]
            else:
                rows[:, part] = old[:, part]
        states.write(shard, rows)


def masters_to_take(shards: list[Shard]) -> list[torch.Tensor]:
    """The fp32 parameters this optimizer keeps no master row for (they are their own
    masters), whole on this process, once each: where a loaded state holds a
    ``master_param`` for one (saved by a run that computed in a narrower dtype, whose model
    weights are the masters' rounding), the parameter takes it."""
    out: dict[int, torch.Tensor] = {}
    for shard in shards:
        if shard.master:
            continue
        for seg in shard.segments:
            owner = seg.owner
            if seg.param.dtype == torch.float32 and (owner is None or owner[0].partition is None):
                out.setdefault(id(seg.param), seg.param)
    return list(out.values())
