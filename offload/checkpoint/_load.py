"""load_checkpoint and load_state_dict_from: checked against the model first, then streamed
into whatever tiers the model and optimizer use now, each piece verified by its checksum."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
from torch import nn

from .._units import format_size
from ..io import BufferPool
from ..optim import OffloadOptimizer
from ..params import narrows
from ._catalog import Catalog, Tensorish, catalog
from ._format import ALIGN, MANIFEST, CheckpointError, dtype_of, read_manifest, tensor_of
from ._optim_state import check_optimizer, load_torch_optimizer, offload_optimizer_items
from ._optimizers import innermost_optimizer
from ._save import resources
from ._stream import BlobReader, ReadItem, ReadRun, merge_runs

__all__ = ["load_checkpoint", "load_state_dict_from"]

log = logging.getLogger(__name__)


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (wrapped with any
    tier layout and budget, or plain) and ``optimizer``; returns the ``extra`` it was saved with.

    Everything is checked before anything is changed: the manifest and files are complete,
    the model's names and shapes match (an error lists every difference), the optimizer's
    class and parameters match. Each tensor's checksum is verified as it streams in; a
    mismatch raises (the model then holds a mix of old and new values: load another
    checkpoint).

    A checkpoint saved by several ranks loads into any number of ranks (each reads the
    elements of its own slices from whichever rank's files hold them) or into one process;
    one saved by a single process loads into several ranks. With several ranks every rank
    calls it, and every rank raises if any rank failed.
    """
    path = os.fspath(path)
    optimizer = innermost_optimizer(optimizer, "load_checkpoint")
    cat = catalog(model, reading=False)  # (a load mends weights a stopped step left mixed)
    part = cat.manager.partition if cat.manager is not None else None
    if part is None:
        return _load(path, read_manifest(path), model, optimizer, cat)
    manifest, error = None, None
    if part.rank == 0:  # one reader of the directory (its recovery of interrupted saves included)
        try:
            manifest = read_manifest(path)
        except BaseException as err:  # noqa: BLE001 - reported to every rank
            error = err
    manifest, error = part.broadcast_object((manifest, error))
    if error is not None:
        raise error
    mine = None
    try:
        extra = _load(path, manifest, model, optimizer, cat)
    except BaseException as err:  # noqa: BLE001 - every rank must hear of it
        mine = f"rank {part.rank}: {type(err).__name__}: {err}"
        part.gather_objects(mine)
        raise
    errors = [e for e in part.gather_objects(mine) if e is not None]
    if errors:
        raise CheckpointError(f"load_checkpoint({path!r}) failed on another rank: " + "; ".join(errors))
    return extra


def _load(path: str, manifest: dict, model: nn.Module, optimizer: Any, cat: Catalog) -> Any:
    started = time.perf_counter()
    model_items = _model_items(manifest, cat)
    opt_plan = check_optimizer(manifest, optimizer, cat) if optimizer is not None else None
    pool, window, engine_args = resources(cat, optimizer)
    reader = BlobReader(path, pool=pool, window=window, engine_args=engine_args)
    total = sum(i.nbytes for i in model_items)
    try:
        if isinstance(optimizer, OffloadOptimizer):
            # one stream for both, so the disk never idles between them (the optimizer's items
            # come after the model's: a missing master row is taken from the loaded weights);
            # a load that fails half way leaves the optimizer refusing to step
            view = optimizer.checkpoint_view()
            with view.loading(opt_plan["info"].get("scaler")):
                opt_items = offload_optimizer_items(view, optimizer, opt_plan)
                reader.run(model_items + opt_items, total + sum(i.nbytes for i in opt_items))
        else:
            reader.run(model_items, total)
            if optimizer is not None:
                load_torch_optimizer(optimizer, manifest, opt_plan, reader)
    except CheckpointError as err:  # found while streaming: some tensors were already replaced
        why = f"{path!r} was replaced while it was being read (another process saved to it): load it again. " \
            if _replaced(path, manifest) else ""
        raise CheckpointError(f"{why}{err} (the model{' and optimizer' if optimizer is not None else ''} now "
                              "hold a mix of old and loaded values: load another checkpoint before "
                              "training on)") from err
    finally:
        if cat.manager is None and not isinstance(optimizer, OffloadOptimizer):
            pool.close()
    if cat.manager is not None:
        cat.manager.pending.mend()  # (every weight loaded: what a stopped step left mixed is whole again)
        logged = manifest["model"].get("steps_logged")
        if logged is not None:  # (the step log's records go on from the saved run's, not from 0)
            cat.manager.steplog.steps = logged
    seconds = time.perf_counter() - started
    size = sum(manifest["files"].values())
    log.info("checkpoint %s loaded: %s in %.2f s (%.2f GB/s)", path, format_size(size), seconds,
             size / seconds / 1e9 if seconds else 0.0)
    return manifest.get("extra")


def _replaced(path: str, manifest: dict) -> bool:
    """Whether the checkpoint at ``path`` is now another save's than ``manifest`` (a save that
    swapped its directory in while this load read the files)."""
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            return json.load(fh).get("id") != manifest.get("id")
    except (OSError, ValueError):  # (gone, or mid-swap: not said, the error stands as it is)
        return False


def load_state_dict_from(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint as plain CPU tensors by name (tied parameters under
    each name), verified, for ``model.load_state_dict`` on a model that is not wrapped."""
    manifest = read_manifest(os.fspath(path))
    out: dict[str, torch.Tensor] = {}
    items = []
    for entry in _model_entries(manifest):
        dtype, shape = dtype_of(entry["dtype"]), tuple(entry["shape"])

        def consume(data: torch.Tensor, entry=entry, dtype=dtype, shape=shape) -> None:
            if "start" in entry:  # a slice saved by one of several ranks
                value = out.get(entry["name"])
                if value is None:
                    value = torch.empty(shape, dtype=dtype)
                start, n = entry["start"], entry["numel"]
                value.view(-1)[start: start + n].copy_(tensor_of(data[: entry["length"]], dtype, (n,)))
            else:
                value = tensor_of(data[: entry["length"]], dtype, shape).clone()
            for name in [entry["name"], *entry.get("aliases", [])]:
                out[name] = value

        items.append(ReadItem(entry["length"], [ReadRun(entry["file"], entry["offset"], entry["length"], 0)],
                              [(entry, 0)], consume))
    pool = BufferPool(1 << 62, name="checkpoint")
    try:
        BlobReader(path, pool=pool, window=256 << 20).run(items)
    finally:
        pool.close()
    return out


# -- model --------------------------------------------------------------------------------------
def _model_entries(manifest: dict) -> list[dict]:
    return [e for e in manifest["tensors"] if "row" not in e]


def _match_model(manifest: dict, cat: Catalog) -> list[tuple[Tensorish, list[dict]]]:
    """Each tensor of the model and the entries holding it: one, or (saved by several
    ranks) one per slice, ``start``/``numel`` elements each, checked to cover it."""
    saved: dict[str, list[dict]] = {}
    for entry in _model_entries(manifest):
        saved.setdefault(entry["name"], []).append(entry)
    by_alias = {}
    for name, entries in saved.items():
        for n in [name, *entries[0].get("aliases", [])]:
            by_alias.setdefault(n, entries)
    pairs, missing, mismatched, used = [], [], [], set()
    for t in cat.all():
        entries = next((by_alias[n] for n in t.names if n in by_alias), None)
        if entries is None:
            missing.append(t.name)
            continue
        used.update(t.names)
        entry = entries[0]
        if tuple(entry["shape"]) != tuple(t.shape):
            mismatched.append(f"{t.name}: checkpoint {tuple(entry['shape'])}, model {tuple(t.shape)}")
            continue
        _check_cover(t.name, entries)
        pairs.append((t, entries))
    unexpected = [e["name"] for e in _model_entries(manifest)
                  if not any(n in used for n in [e["name"], *e.get("aliases", [])])]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {missing[:20]}")
    if unexpected:
        problems.append(f"not in the model ({len(unexpected)}): {unexpected[:20]}")
    if mismatched:
        problems.append(f"shapes differ ({len(mismatched)}): {mismatched[:20]}")
    if problems:
        raise CheckpointError("the checkpoint does not match the model: " + "; ".join(problems)
                              + ". Build the model from the config the checkpoint was saved with "
                              f"(it was saved from {manifest['model'].get('class')}).")
    return pairs


def _span(entry: dict) -> tuple[int, int]:
    """The elements ``[start, end)`` of the flattened tensor an entry holds."""
    if "start" in entry:
        return entry["start"], entry["start"] + entry["numel"]
    n = 1
    for d in entry["shape"]:
        n *= d
    return 0, n


def _check_cover(name: str, entries: list[dict]) -> None:
    if len(entries) == 1 and "start" not in entries[0]:
        return
    at, end = 0, _span({"shape": entries[0]["shape"]})[1]
    for e in sorted((e for e in entries if e.get("numel", 1)), key=lambda e: _span(e)[0]):
        s, n = _span(e)
        if s != at:
            raise CheckpointError(f"corrupt checkpoint: the slices of {name} saved by its ranks leave elements "
                                  f"{at}..{s} out (the manifest lists a rank's files that are not all there?)")
        at = n
    if at != end:
        raise CheckpointError(f"corrupt checkpoint: the slices of {name} end at element {at} of {end}")


def _model_items(manifest: dict, cat: Catalog) -> list[ReadItem]:
    pairs = _match_model(manifest, cat)
    items: list[ReadItem] = []
    by_group: dict[int, list[tuple[Tensorish, dict]]] = {}
    loose = []
    for t, entries in pairs:
        if t.group is not None:
            by_group.setdefault(id(t.group), []).append((t, entries))
        else:
            loose.append((t, entries))
    for manager, group in cat.groups():
        items.append(_group_item(manager, group, by_group.get(id(group), [])))
    for t, entries in loose:
        for entry in entries:
            def consume(data: torch.Tensor, t=t, entry=entry) -> None:
                s, e = _span(entry)
                value = tensor_of(data[: entry["length"]], dtype_of(entry["dtype"]), (e - s,))
                with torch.no_grad():
                    if "start" in entry:  # one rank's slice
                        t.tensor.view(-1)[s:e].copy_(value)
                    else:
                        t.tensor.copy_(value.view(t.shape))

            items.append(ReadItem(entry["length"], [ReadRun(entry["file"], entry["offset"], entry["length"], 0)],
                                  [(entry, 0)], consume))
    return items


def _group_item(manager: Any, group: Any, members: list[tuple[Tensorish, list[dict]]]) -> ReadItem:
    """The group's flat buffer (with several ranks, this rank's slice of it): each saved
    piece of the same dtype that lies within the elements the slot holds is read straight
    into place (one read when the layout matches the saved one); others (another dtype, or
    a piece cut elsewhere: a checkpoint of another world size) into a scratch area, then
    the overlap is copied (and cast)."""
    runs, checks, copies = [], [], []
    extra = -(-group.nbytes // ALIGN) * ALIGN
    for t, entries in members:
        first, last = t.slot.first, t.slot.first + t.slot.count
        for entry in entries:
            s, e = _span(entry)
            a, b = max(s, first), min(e, last)
            if a >= b:
                continue  # none of the elements this slot holds
            if dtype_of(entry["dtype"]) == t.dtype and first <= s and e <= last:
                at = t.slot.elements(s, 0)[0]
                runs.append(ReadRun(entry["file"], entry["offset"], entry["length"], at))
                checks.append((entry, at))
                continue
            at = extra + entry["offset"] % ALIGN
            runs.append(ReadRun(entry["file"], entry["offset"], entry["length"], at))
            checks.append((entry, at))
            copies.append((t, entry, at, a, b))
            extra = -(-(at + entry["length"]) // ALIGN) * ALIGN
    # parameters of the group that the given module does not hold (it is part of a wrapped
    # model) keep their bytes: read in place, or copied from the group's current bytes
    loaded = {id(t.slot) for t, _ in members}
    kept = [slot for slot in group.slots if id(slot) not in loaded and slot.count]

    def consume(data: torch.Tensor) -> None:
        if kept:
            current = manager.group_bytes(group)
            for slot in kept:
                begin, end = slot.held
                data[begin: end].copy_(current[begin: end])
        wide: dict[int, torch.Tensor] = {}  # trained parameters saved wider than they rest now
        for t, entry, at, a, b in copies:
            s, e = _span(entry)
            source = tensor_of(data[at: at + entry["length"]], dtype_of(entry["dtype"]), (e - s,))
            begin, end = t.slot.elements(a, b - a)
            data[begin: end].view(t.dtype).copy_(source[a - s: b - s])
            if s == 0 and e == t.slot.numel and manager.partition is None and narrows(source, t.slot):
                wide[id(t.slot)] = source
        manager.write_group(group, data[: group.nbytes])
        manager.params_changed(group)
        if wide:  # an optimizer built after this load starts its masters from them
            manager.keep_originals(group, wide)

    def in_place() -> Any:
        if group.resident:
            manager.repoint_resident(group)
        else:
            manager.coordinator.forget(group.whole or group)
        manager.params_changed(group)  # (before the bytes land: the load of the optimizer comes after)
        return manager.store.overwrite_in_place(group.key)

    return ReadItem(extra, merge_runs(runs), checks, consume, in_place=None if copies or kept else in_place)


