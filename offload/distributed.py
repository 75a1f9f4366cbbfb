"""ZeRO-3 partitioning over torch.distributed (gloo on CPU, NCCL on GPU).

Each parameter group's flat buffer is padded to a multiple of ``world * PARAM_ALIGN``
bytes and cut into ``world`` equal slices; rank ``r`` keeps slice ``r`` in its own tiers (its own
``nvme_path``), all-gathers the whole group before a module uses it, reduce-scatters the
group's gradients so that it keeps only its slice's fp32 sums, and its optimizer updates
only that slice. This module holds what is specific to several ranks: resolving the
process group from the config, the checks made at ``wrap`` (same config and model on
every rank, one ``nvme_path`` per rank of a machine), the size of each rank's slice, and
the collectives on byte buffers. Cutting the parameter groups into slices is
``offload.params.slice_groups``: this module imports nothing of ours but ``_units``, so
``params`` may use it without a cycle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._units import PARAM_ALIGN

__all__ = ["Partition", "resolve", "check_ranks", "local_nvme_path"]

# fields that may differ between ranks: each rank's own paths
_PER_RANK_FIELDS = ("nvme_path", "log_path", "trace_path")


@dataclass(frozen=True, eq=False)
class Partition:
    """This process's place in the process group the parameters are partitioned over."""

    process_group: Any  # None: the default group
    rank: int
    world: int
    local_rank: int
    backend: str

    def slice_bytes(self, nbytes: int) -> int:
        """Bytes of each rank's slice of a group of ``nbytes`` (padded: equal slices, each a
        multiple of ``PARAM_ALIGN`` bytes, so every element of every dtype falls in one slice)."""
        unit = self.world * PARAM_ALIGN
        return max(1, -(-nbytes // unit)) * unit // self.world

    @property
    def device(self) -> torch.device:
        """Where the collectives' tensors must be (NCCL works on CUDA tensors only)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, *, async_op: bool = False) -> Any:
        """``out`` (world slices of ``mine``'s size) receives every rank's slice."""
        return dist.all_gather_into_tensor(out, mine, group=self.process_group, async_op=async_op)

    def reduce_scatter_mean(self, out: torch.Tensor, whole: torch.Tensor) -> None:
        """``out`` receives this rank's slice of the mean over ranks of ``whole`` (the mean,
        like DistributedDataParallel: each rank's loss averages its own batch)."""
        dist.reduce_scatter_tensor(out, whole, op=dist.ReduceOp.SUM, group=self.process_group)
        out.mul_(1.0 / self.world)

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return t.cpu().tolist()

    def max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return t.cpu().tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        return box[0]

    def gather_bytes(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's slice (uint8 host tensors of equal size), concatenated, on the host."""
        src = mine.to(self.device)
        out = torch.empty(src.numel() * self.world, dtype=torch.uint8, device=self.device)
        self.all_gather(out, src)
        return out.cpu()


def resolve(config: Any, process_group: Any = None) -> Partition | None:
    """The partition ``config`` asks for, or None for a single process.

    ``world_size=None`` follows torch.distributed: partitioned over the process group when
    one is initialised (``process_group``, else the default group) with more than one rank.
    """
    requested = config.world_size
    ready = dist.is_available() and dist.is_initialized()
    if not ready:
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised: call "
                             "torch.distributed.init_process_group() first")
        if requested is not None and requested > 1:
            raise ValueError(
                f"OffloadConfig(world_size={requested}) but torch.distributed is not initialised: launch "
                f"with `torchrun --nproc_per_node {requested} train.py` and call "
                "torch.distributed.init_process_group() (backend 'gloo' on CPU, 'nccl' on GPU) before "
                "offload.wrap, or set world_size=None for a single process")
        return None
    world = dist.get_world_size(process_group)
    if requested is not None and requested != world:
        raise ValueError(f"OffloadConfig(world_size={requested}) but the process group has {world} ranks: "
                         "set world_size to the number of ranks torchrun starts, or None to follow the "
                         "process group")
    if world == 1:
        return None
    backend = str(dist.get_backend(process_group))
    rank = dist.get_rank(process_group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if config.torch_device.type == "cuda" and backend != "nccl" and "nccl" not in backend:
        raise ValueError(f"device={config.device!r} with a {backend!r} process group: initialise it with "
                         "backend='nccl' (gloo moves CUDA tensors through host memory)")
    if config.torch_device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"device='cpu' with a {backend!r} process group: initialise it with backend='gloo'")
    return Partition(process_group, rank, world, local_rank, "nccl" if "nccl" in backend else "gloo")


def local_nvme_path(config: Any, partition: Partition | None) -> str | None:
    """``config.nvme_path`` with ``{rank}`` and ``{local_rank}`` filled in (0 in a single
    process, so one config serves both)."""
    path = config.nvme_path
    if path is None or "{" not in path:
        return path
    rank = partition.rank if partition is not None else 0
    local = partition.local_rank if partition is not None else 0
    try:
        return path.format(rank=rank, local_rank=local)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"nvme_path={path!r}: only {{rank}} and {{local_rank}} may be filled in "
                         f"({err!r})") from None


def fingerprint(config: Any, model: nn.Module, values: bool = True) -> dict[str, str]:
    """Digests of what must be equal on every rank: the config (less each rank's own
    paths) and the model's parameters and buffers (names, shapes, dtypes)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in _PER_RANK_FIELDS}
    params = [(n, list(p.shape), str(p.dtype), bool(p.requires_grad))
              for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return {"config": json.dumps(fields, default=str, sort_keys=True),
            "model": hashlib.sha256(json.dumps([params, buffers]).encode()).hexdigest(),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "params": json.dumps(params), "values": json.dumps(_value_digests(model) if values else [])}


def _value_digests(model: nn.Module) -> list[tuple[str, int]]:
    """A CRC of each parameter's bytes (none for one on the meta device, to be loaded from a
    checkpoint): each rank keeps its slice of its own copy, so copies that differ (a model
    built with another seed on each rank, where DDP would broadcast rank 0's) would be mixed
    slice by slice."""
    out = []
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        data = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out.append((name, zlib.crc32(data)))
    return out


def check_ranks(partition: Partition, config: Any, model: nn.Module, nvme_path: str | None, *,
                values: bool = True) -> None:
    """Refuse, on every rank alike, ranks that differ in config or model, and two ranks of
    one machine sharing a swap directory. ``values``: compare the parameters' bytes too
    (False where a checkpoint gives every rank its values)."""
    mine = fingerprint(config, model, values)
    mine["host"] = socket.gethostname()
    mine["nvme_path"] = nvme_path if "nvme" in (config.param_tier, config.optimizer_tier) else None
    mine["template"] = config.nvme_path
    everyone = partition.gather_objects(mine)
    first = everyone[0]
    for rank, other in enumerate(everyone[1:], start=1):
        if other["config"] != first["config"]:
            a, b = json.loads(first["config"]), json.loads(other["config"])
            diff = [f"{k}: {a.get(k)!r} on rank 0, {b.get(k)!r} on rank {rank}"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            raise ValueError("the ranks were given different OffloadConfigs (" + "; ".join(diff[:5])
                             + "): every rank must wrap with the same config (only nvme_path, log_path "
                             "and trace_path may differ)")
        if other["model"] != first["model"]:
            a, b = json.loads(first["params"]), json.loads(other["params"])
            diff = next((f"{x[0]} {x[1]} {x[2]} on rank 0, {y[0]} {y[1]} {y[2]} on rank {rank}"
                         for x, y in zip(a, b) if x != y),
                        f"{len(a)} parameters on rank 0, {len(b)} on rank {rank}")
            raise ValueError(f"the ranks wrap different models ({first['model_class']} on rank 0, "
                             f"{other['model_class']} on rank {rank}; first difference: {diff}): build the "
                             "same model from the same config on every rank")
        if other["values"] != first["values"]:
            a, b = dict(json.loads(first["values"])), dict(json.loads(other["values"]))
            name = next((n for n in a if a[n] != b.get(n)), next(iter(b), "?"))
            raise ValueError(f"the ranks hold different values of the model's parameters (first: {name!r} on rank 0 "
                             f"and rank {rank}): each rank keeps its slice of its own copy, so the model would be "
                             "a mix of them (DDP broadcasts rank 0's; offload does not). Seed the build alike on "
                             "every rank (torch.manual_seed before building), or load the weights from one "
                             "checkpoint (offload.wrap(..., checkpoint=dir))")
    seen: dict[tuple[str, str], int] = {}
    for rank, info in enumerate(everyone):
        if info["nvme_path"] is None:
            continue
        key = (info["host"], os.path.normpath(info["nvme_path"]))
        if key in seen:
            raise ValueError(
                f"ranks {seen[key]} and {rank} on host {info['host']!r} share nvme_path "
                f"{info['nvme_path']!r}: each rank needs its own swap directory. Put {{rank}} in the "
                f"path, e.g. nvme_path={(info['template'].rstrip('/') + '/rank{rank}')!r}")
        seen[key] = rank
