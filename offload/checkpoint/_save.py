"""save_checkpoint and state_dict: every tier's state, streamed a blob at a time."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

import torch
from torch import nn

from .._resolve import resolve_engine
from .._units import format_size
from ..io import BufferPool
from ..optim import OffloadOptimizer
from ._blobs import model_blobs
from ._catalog import Catalog, catalog
from ._format import FORMAT, MANIFEST, AtomicDirectory, CheckpointError, sealed, version_of, write_json
from ._optim_state import optimizer_blobs
from ._optimizers import innermost_optimizer
from ._stream import Blob, BlobWriter

__all__ = ["save_checkpoint", "state_dict", "resources"]

log = logging.getLogger(__name__)
_WINDOW = 512 << 20  # most bytes of save/load buffers held at once


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    extra: dict | None = None) -> None:
    """Save ``model`` (wrapped or not) and ``optimizer`` into the directory ``path``.

    Every parameter group and optimizer shard is streamed from the tier where it rests
    into the checkpoint's files with host memory bounded by the host budget (never the
    whole model), checksummed, and listed in ``manifest.json``. The directory appears
    atomically: a crash at any moment leaves the previous checkpoint at ``path`` (if any)
    intact, and load refuses anything incomplete. ``extra`` is a small JSON-able dict
    (step, scheduler state, :func:`offload.rng_state` ...) returned by ``load_checkpoint``.

    Call it between optimizer steps: gradients accumulated since the last ``step()`` are
    not saved.

    With several ranks (a model partitioned by ``offload.wrap`` over torch.distributed),
    every rank calls it with the same ``path``, which must be on a file system they all
    see: each rank writes its slices into ``path/rank-N/`` and rank 0 writes the manifest
    of the whole, which records the global layout; it loads into any number of ranks.
    """
    started = time.perf_counter()
    path = os.fspath(path)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    optimizer = innermost_optimizer(optimizer, "save_checkpoint")
    extra_json = _check_extra(extra)
    cat = catalog(model)
    if cat.manager is not None and cat.manager.partition is not None:
        _save_partitioned(path, model, optimizer, extra_json, cat, started)
        return
    blobs, opt_info, writer, pool = _writer(cat, optimizer)
    directory = AtomicDirectory(path)
    try:
        writer.check_space(directory.path)
        writer.run(directory.tmp)
        manifest = {
            "format": FORMAT, "version": version_of(opt_info), "id": uuid.uuid4().hex,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": dict(writer.sizes),
            "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                      "wrapped": cat.manager is not None,
                      "config": _config_summary(cat), "steps_logged": _steps_logged(cat)},
            "tensors": [piece.entry for blob in blobs for piece in blob.pieces],
            "optimizer": opt_info,
            "extra": extra_json,
        }
        write_json(os.path.join(directory.tmp, MANIFEST), sealed(manifest))
        directory.commit()
    except BaseException:
        directory.abort()
        raise
    finally:
        if cat.manager is None:
            pool.close()
    seconds = time.perf_counter() - started
    log.info("checkpoint %s saved: %s in %.2f s (%.2f GB/s)", directory.path, format_size(writer.total),
             seconds, writer.total / seconds / 1e9 if seconds else 0.0)


def _writer(cat: Catalog, optimizer: Any) -> tuple[list[Blob], dict | None, BlobWriter, BufferPool]:
    """The blobs of the model (and optimizer), the optimizer's manifest part, and the writer
    that streams them through the model's buffer pool (returned too)."""
    blobs = model_blobs(cat)
    opt_info = None
    if optimizer is not None:
        opt_blobs, opt_info = optimizer_blobs(optimizer, cat)
        blobs += opt_blobs
    pool, window, engine_args = resources(cat, optimizer)
    return blobs, opt_info, BlobWriter(blobs, pool=pool, window=window, engine_args=engine_args), pool


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers as plain CPU tensors, gathered from
    wherever they rest (for models that fit in RAM). Tied parameters appear under each of
    their names, as the same tensor, like ``nn.Module.state_dict``. With several ranks every
    rank must call it (each group is all-gathered) and every rank gets the whole model."""
    cat = catalog(model)
    out: dict[str, torch.Tensor] = {}
    cache: tuple[Any, torch.Tensor] | None = None
    for t in cat.all():
        if t.group is not None:
            if cache is None or cache[0] is not t.group:  # (several ranks: gathered, a collective)
                cache = (t.group, t.manager.whole_bytes(t.group))
            slot = t.slot.whole or t.slot
            raw = cache[1][slot.offset: slot.offset + slot.nbytes]
            value = raw.view(t.dtype).reshape(t.shape).clone() if slot.nbytes else \
                torch.empty(t.shape, dtype=t.dtype)
        else:
            value = t.tensor.detach().to("cpu", copy=True)
        for name in t.names:
            out[name] = value
    return out


# -- what to write ----------------------------------------------------------------------------
def _save_partitioned(path: str, model: nn.Module, optimizer: Any, extra_json: Any, cat: Catalog,
                      started: float) -> None:
    """Several ranks: each writes its slices into ``path/rank-N`` of rank 0's temporary
    directory; rank 0 writes the manifest of the whole and puts the directory in place.
    Every rank raises when any rank failed, and nothing replaces ``path`` then."""
    part = cat.manager.partition
    directory, error = None, None
    if part.rank == 0:
        try:
            directory = AtomicDirectory(path)
        except BaseException as err:  # noqa: BLE001 - reported to every rank below
            error = f"{type(err).__name__}: {err}"
    tmp, error = part.broadcast_object((directory.tmp if directory is not None else None, error))
    if error is not None:
        raise CheckpointError(f"save_checkpoint: rank 0 could not start the checkpoint: {error}")
    mine: Any = None
    total = 0
    try:
        if not os.path.isdir(tmp):
            raise CheckpointError(f"rank {part.rank} does not see {tmp!r}, which rank 0 created: the "
                                  "checkpoint path must be on a file system every rank sees (a shared "
                                  "mount), or run on one machine")
        sub = os.path.join(tmp, f"rank-{part.rank}")
        os.mkdir(sub, 0o755)
        blobs, opt_info, writer, _ = _writer(cat, optimizer)
        writer.check_space(sub)
        writer.run(sub)
        total = writer.total
        prefix = f"rank-{part.rank}/"
        tensors = []
        for blob in blobs:
            for piece in blob.pieces:
                entry = dict(piece.entry)
                entry["file"] = prefix + entry["file"]
                tensors.append(entry)
        mine = {"files": {prefix + k: v for k, v in writer.sizes.items()}, "tensors": tensors,
                "optimizer": opt_info}
    except BaseException as err:  # noqa: BLE001 - every rank must hear of it before anyone commits
        mine = {"error": f"rank {part.rank}: {type(err).__name__}: {err}"}
        if not isinstance(err, Exception):
            part.gather_objects(mine)
            raise
    everyone = part.gather_objects(mine)
    errors = [m["error"] for m in everyone if "error" in m]
    if not errors and part.rank == 0:
        try:
            manifest = _merged_manifest(everyone, model, cat, extra_json)
            write_json(os.path.join(tmp, MANIFEST), sealed(manifest))
            directory.commit()
        except BaseException as err:  # noqa: BLE001
            errors.append(f"rank 0: {type(err).__name__}: {err}")
    if part.rank == 0 and errors:
        directory.abort()
    errors = part.broadcast_object(errors)
    if errors:
        raise CheckpointError(f"save_checkpoint({path!r}) failed on {len(errors)} rank(s), nothing was "
                              "replaced: " + "; ".join(errors))
    total = sum(part.gather_objects(total))
    seconds = time.perf_counter() - started
    if part.rank == 0:
        log.info("checkpoint %s saved by %d ranks: %s in %.2f s (%.2f GB/s)", os.path.abspath(path), part.world,
                 format_size(total), seconds, total / seconds / 1e9 if seconds else 0.0)


def _merged_manifest(everyone: list[dict], model: nn.Module, cat: Catalog, extra_json: Any) -> dict:
    files: dict[str, int] = {}
    tensors: list[dict] = []
    opt_info = None
    for rank_info in everyone:
        files.update(rank_info["files"])
        tensors += rank_info["tensors"]
        info = rank_info["optimizer"]
        if info is not None:
            if opt_info is None:
                opt_info = dict(info, state={})
            for name, values in info.get("state", {}).items():
                opt_info["state"].setdefault(name, {}).update(values)
    part = cat.manager.partition
    return {
        "format": FORMAT, "version": version_of(opt_info), "id": uuid.uuid4().hex,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}", "wrapped": True,
                  "config": _config_summary(cat), "steps_logged": _steps_logged(cat)},
        "distributed": {"world_size": part.world, "backend": part.backend,
                        "ranks": [f"rank-{r}" for r in range(part.world)],
                        "layout": "each parameter's elements [start, start + numel) per rank"},
        "tensors": tensors,
        "optimizer": opt_info,
        "extra": extra_json,
    }


def resources(cat: Catalog, optimizer: Any = None) -> tuple[BufferPool, int, dict]:
    """The host buffer pool to stream through (the wrapped model's, so buffers count in its
    host budget), the window of bytes held at once, and the file engine's settings. The
    window is half of what the pool has free now (what the run holds already, gradients
    resting in host memory, is not the stream's), so that a load's puts, which stage a group
    for NVMe beside the buffers read ahead, find the other half."""
    manager = cat.manager
    own = optimizer.checkpoint_view().staging if isinstance(optimizer, OffloadOptimizer) else None
    if manager is None and own is not None:
        return own, min(_WINDOW, (own.budget - own.in_use_bytes) // 2), {}
    if manager is None:
        return BufferPool(1 << 62, name="checkpoint"), _WINDOW, {}
    cfg = manager.config
    pool = manager.store.staging
    settings = resolve_engine(cfg)
    engine = {"block_size": settings.block_size, "threads": settings.threads, "queue_depth": settings.queue_depth}
    return pool, min(_WINDOW, (pool.budget - pool.in_use_bytes) // 2), engine


def _check_extra(extra: Any) -> Any:
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of JSON-able values, got {type(extra).__name__}")
    try:
        text = json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"extra cannot be saved: {err}. Pass JSON-able values (numbers, strings, "
                              "lists, dicts); offload.rng_state() gives the RNG state in that form") from None
    if len(text) > (16 << 20):
        raise CheckpointError(f"extra is {len(text)} bytes of JSON; it is meant for small metadata "
                              "(step, RNG, scheduler). Save tensors with the model instead")
    return json.loads(text)


def _steps_logged(cat: Catalog) -> int | None:
    """The step log's count, so that a resumed run's records go on from it."""
    return None if cat.manager is None else cat.manager.steplog.steps


def _config_summary(cat: Catalog) -> dict | None:
    if cat.manager is None:
        return None
    cfg = cat.manager.config
    out = {}
    for key in ("device", "param_tier", "optimizer_tier", "dtype"):
        value = getattr(cfg, key, None)
        out[key] = str(value) if value is not None else None
    return out

