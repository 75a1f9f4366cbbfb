"""An optimizer's state in a checkpoint: what a save writes (an offload optimizer's shard rows
through its ``CheckpointView``, a torch optimizer's states packed), and what a load checks and
reads back into the optimizer of the loading run, whatever its layout."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..optim import BLOCK, CheckpointView, OffloadOptimizer, ShardRows, decode_piece
from ._blobs import manifest_entry, packed
from ._catalog import Catalog
from ._format import ALIGN, CheckpointError, dtype_name, dtype_of, jsonable, tensor_of
from ._stream import Blob, BlobReader, Piece, ReadItem, ReadRun, merge_runs

__all__ = ["optimizer_blobs", "check_optimizer", "offload_optimizer_items", "load_torch_optimizer"]

log = logging.getLogger(__name__)


# -- save -----------------------------------------------------------------------------------------
def optimizer_blobs(optimizer: torch.optim.Optimizer, cat: Catalog) -> tuple[list[Blob], dict]:
    names: dict[int, str] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            name = cat.param_name(p)
            if name is None:
                raise CheckpointError(f"optimizer parameter {pi} of param group {gi} (shape "
                                      f"{tuple(p.shape)}) is not a parameter of the model: save the "
                                      "optimizer with the model it trains")
            names[id(p)] = name
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: jsonable(v, f"param_groups[...][{k!r}]") for k, v in group.items() if k != "params"}
        hyper["params"] = [names[id(p)] for p in group["params"]]
        groups.append(hyper)
    info: dict[str, Any] = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                            "param_groups": groups}
    if isinstance(optimizer, OffloadOptimizer):
        return _offload_blobs(optimizer, names, info)
    return _torch_blobs(optimizer, names, info)


def _offload_blobs(opt: OffloadOptimizer, names: dict[int, str], info: dict) -> tuple[list[Blob], dict]:
    view = opt.checkpoint_view()
    shards = view.shards()
    if view.holds_gradients():
        log.warning("save_checkpoint: gradients accumulated since the last optimizer step are not saved; "
                    "save after step() and zero_grad()")
    info["format"] = "offload"
    info["scaler"] = view.scaler_state()
    state: dict[str, dict] = {}
    blobs: list[Blob] = []
    info["moments"], info["master"] = view.moments, view.master
    for shard in shards:
        pieces = []
        packing = shard.packing
        for seg in shard.segments:
            name = names[id(seg.param)]
            state.setdefault(name, {})["step"] = float(seg.step)
            for r, row in enumerate(shard.names):
                for f in packing.fields(r, seg.offset, seg.length):
                    extra = {"block": BLOCK} if f.suffix else {}
                    entry = manifest_entry(name, None, row=row + f.suffix, dtype=f.dtype, shape=list(seg.param.shape),
                                           start=seg.start, numel=seg.length, **extra)
                    pieces.append(Piece(entry, f.at, f.length))
        if shard.nbytes:  # (SGD without momentum keeps step counts only)
            blobs.append(Blob("optimizer.bin", shard.nbytes, shard.read_into, pieces, borrow=shard.borrow))
    info["state"] = state
    return blobs, info


def _torch_blobs(opt: torch.optim.Optimizer, names: dict[int, str], info: dict) -> tuple[list[Blob], dict]:
    info["format"] = "torch"
    state: dict[str, dict] = {}
    tensors: list[tuple[torch.Tensor, dict]] = []
    for p, values in opt.state.items():
        name = names.get(id(p))
        if name is None:
            continue
        entry_state = state.setdefault(name, {})
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors.append((value, manifest_entry(name, None, row=key, dtype=dtype_name(value.dtype),
                                                      shape=list(value.shape), device=value.device.type)))
            else:
                entry_state[key] = jsonable(value, f"optimizer state {key!r} of {name}")
    info["state"] = state
    return packed("optimizer.bin", tensors), info


# -- helpers ------------------------------------------------------------------------------------


# -- load -----------------------------------------------------------------------------------------
def check_optimizer(manifest: dict, optimizer: torch.optim.Optimizer, cat: Catalog) -> dict:
    info = manifest.get("optimizer")
    if info is None:
        raise CheckpointError("the checkpoint holds no optimizer state (it was saved without an optimizer): "
                              "call load_checkpoint(path, model) and start the optimizer afresh")
    ours = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if info["class"].rsplit(".", 1)[-1] != type(optimizer).__name__ or \
            (info["format"] == "offload") != isinstance(optimizer, OffloadOptimizer):
        raise CheckpointError(f"the checkpoint's optimizer is {info['class']}, this one is {ours}: "
                              "build the same optimizer class to resume")
    saved_groups = info["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one "
                              f"{len(optimizer.param_groups)}")
    names: list[list[str]] = []
    sizes: dict[str, int] = {}
    problems = []
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        here = []
        for p in group["params"]:
            name = cat.param_name(p)
            if name is None:
                raise CheckpointError(f"a parameter of param group {gi} (shape {tuple(p.shape)}) is not a "
                                      "parameter of the model being loaded")
            here.append(name)
            sizes[name] = p.numel()
        if here != saved["params"]:
            gone = sorted(set(saved["params"]) - set(here))[:10]
            new = sorted(set(here) - set(saved["params"]))[:10]
            problems.append(f"param group {gi}: " + (f"missing {gone} " if gone else "")
                            + (f"new {new} " if new else "") + ("(order differs)" if not gone and not new else ""))
        names.append(here)
    if problems:
        raise CheckpointError("the optimizer's parameters differ from the checkpoint's: " + "; ".join(problems))
    pieces: dict[tuple[str, str], list[dict]] = {}
    for entry in manifest["tensors"]:
        if "row" in entry:
            pieces.setdefault((entry["name"], entry["row"]), []).append(entry)
    for key, entries in pieces.items():
        entries.sort(key=lambda e: e.get("start", 0))
        if "start" in entries[0]:
            at = 0
            for e in entries:
                if e["start"] != at:
                    raise CheckpointError(f"corrupt manifest: optimizer state {key[1]} of {key[0]} has a gap "
                                          f"at element {at}")
                at += e["numel"]
    if info["format"] == "offload":
        _check_complete(info, pieces, [[n for n in here if sizes[n]] for here in names],
                        [type(optimizer).rows_of(saved) for saved in saved_groups])
    return {"names": names, "pieces": pieces, "info": info}


def _check_complete(info: dict, pieces: dict[tuple[str, str], list[dict]], names: list[list[str]],
                    rows_of_group: list[tuple[str, ...]]) -> None:
    """An offload checkpoint holds a step count and every state row whole for each of its
    optimizer's parameters (``_offload_blobs`` writes them, zeros for a parameter never
    updated); the rows are those of the parameter's group (SGD's momentum, AdamW's amsgrad
    are settings of a group). A manifest that lacks one was edited or damaged: refused rather
    than loaded with a step of 0 or rows left as the load's scratch held them. (A master row
    may be absent: it is then taken from the loaded weights.) ``names``: per param group, its
    parameters that have elements (one of none has nothing saved); ``rows_of_group``: the rows
    the optimizer keeps under each saved group's settings, so a row deleted for every member of
    a group is missed too."""
    problems = []
    for group, expected in zip(names, rows_of_group):
        members = set(group)
        rows = {row for n, row in pieces if n in members and row != "master_param" and not row.endswith(".scales")}
        rows |= set(expected)
        for name in group:
            if "step" not in info["state"].get(name, {}):
                problems.append(f"{name} has no step count")
            for row in sorted(rows | ({"master_param"} if (name, "master_param") in pieces else set())):
                entries = pieces.get((name, row), [])
                numel = math.prod(entries[0]["shape"]) if entries else None
                covered = sum(e["numel"] for e in entries)
                if numel is None or covered != numel:
                    problems.append(f"{name}'s {row} " + ("is missing" if numel is None else
                                                          f"covers {covered} of its {numel} elements"))
    if problems:
        raise CheckpointError("corrupt manifest: the optimizer state is incomplete: " + "; ".join(problems[:5])
                              + (f" and {len(problems) - 5} more" if len(problems) > 5 else ""))


def _restore_groups(optimizer: torch.optim.Optimizer, info: dict) -> None:
    for group, saved in zip(optimizer.param_groups, info["param_groups"]):
        for key, value in saved.items():
            if key == "params":
                continue
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            if isinstance(group.get(key), torch.Tensor):
                group[key].fill_(value)
                continue
            group[key] = value


def offload_optimizer_items(view: CheckpointView, opt: OffloadOptimizer, plan: dict) -> list[ReadItem]:
    """The read items that fill ``opt``'s state rows (inside ``view.loading()``: the groups'
    settings and step counts are set here)."""
    info, pieces = plan["info"], plan["pieces"]
    _restore_groups(opt, info)
    cat_names = {id(p): n for group, names in zip(opt.param_groups, plan["names"])
                 for p, n in zip(group["params"], names)}
    for what, mine in (("moments", view.moments), ("master", view.master)):
        saved = info.get(what, "fp32")
        if saved != mine:
            log.info("load_checkpoint: the checkpoint's optimizer %s were kept as %s, this optimizer keeps them "
                     "as %s: converted", what, saved, mine)
    items = []
    for shard in view.shards():
        for seg in shard.segments:
            step = info["state"].get(cat_names[id(seg.param)], {}).get("step", 0.0)
            seg.step.fill_(float(step))
        if shard.nbytes:
            items.append(_shard_item(view, shard, cat_names, pieces))
    taken = []
    for p in view.masters_to_take():
        saved = sorted(pieces.get((cat_names[id(p)], "master_param"), []), key=lambda e: e["start"])
        if saved and all(e["dtype"] == "F32" for e in saved) and _covers(saved, p.numel()):
            taken.append(_master_item(p, saved))
    if taken:
        log.info("load_checkpoint: %d fp32 parameters take the checkpoint's fp32 master weights (it was saved by a "
                 "run that computed in a narrower dtype; its model weights are their rounding)", len(taken))
    return items + taken


def _covers(entries: list[dict], numel: int) -> bool:
    at = 0
    for e in entries:
        if e["start"] != at:
            return False
        at += e["numel"]
    return at == numel


def _master_item(param: torch.Tensor, entries: list[dict]) -> ReadItem:
    """A parameter's saved fp32 master (its pieces, in order) written into it in one write
    (after the model's items: it replaces the rounded weight just loaded). Each piece is
    read where its file offset keeps O_DIRECT's alignment, then laid out whole."""
    runs, places, end = [], [], 0
    for e in entries:
        at = -(-end // ALIGN) * ALIGN + e["offset"] % ALIGN
        runs.append(ReadRun(e["file"], e["offset"], e["length"], at))
        places.append((e, at))
        end = at + e["length"]

    def consume(data: torch.Tensor) -> None:
        value = torch.empty(param.numel(), dtype=torch.float32)
        for e, at in places:
            value[e["start"]: e["start"] + e["numel"]] = tensor_of(data[at: at + e["length"]], torch.float32,
                                                                  (e["numel"],))
        with torch.no_grad():
            param.copy_(value.view(param.shape))

    return ReadItem(end, runs, places, consume)


def _shard_item(view: CheckpointView, shard: ShardRows, names: dict, pieces: dict) -> ReadItem:
    """Reads a shard's rows from the checkpoint's pieces into their fp32 layout (F32 pieces
    in place; bf16 and 8-bit pieces into scratch, decoded), then hands them to the optimizer,
    which codes them as it keeps them. A piece coded with the same blocks codes back to the
    same bytes (``offload.optim._formats``): a same-layout resume is bit for bit."""
    row_bytes = shard.numel * 4
    runs, checks, copies, zeros, masters, decodes = [], [], [], [], [], []
    scratched: dict[int, dict] = {}  # pieces read into scratch, placed after the decoded rows (_placed)

    def scratch(e: dict) -> int:
        scratched[id(e)] = e
        return id(e)

    for seg in shard.segments:
        name = names[id(seg.param)]
        lo, hi = seg.start, seg.start + seg.length
        for r, row in enumerate(shard.names):
            dest = r * row_bytes + seg.offset * 4
            saved = pieces.get((name, row))
            if not saved:
                (masters if row == "master_param" else zeros).append((seg, dest))
                continue
            scales = {e["start"]: e for e in pieces.get((name, row + ".scales"), [])}
            for e in saved:
                s, n = e["start"], e["numel"]
                if s + n <= lo or s >= hi:
                    continue
                a, b = max(s, lo), min(s + n, hi)
                if e["dtype"] != "F32":  # coded: decoded in full, the overlap copied
                    if e["dtype"] in ("U8", "I8"):
                        if s not in scales or scales[s].get("block") != BLOCK:
                            raise CheckpointError(
                                f"optimizer state {row} of {name}: its block scales from element {s} are "
                                + ("missing (corrupt manifest)" if s not in scales else
                                   f"per {scales[s].get('block')} elements, this offload codes {BLOCK}"))
                        scale_at = scratch(scales[s])
                    else:
                        scale_at = None
                    decodes.append((e, scratch(e), scale_at, a - s, dest + (a - lo) * 4, b - a))
                elif s >= lo and s + n <= hi:  # the piece lies inside this segment: read in place
                    at = dest + (s - lo) * 4
                    runs.append(ReadRun(e["file"], e["offset"], e["length"], at))
                    checks.append((e, at))
                else:  # it spans a segment boundary (shards cut differently): scratch, then copy
                    copies.append((scratch(e), (a - s) * 4, dest + (a - lo) * 4, (b - a) * 4))

    extra, at_of = _placed(list(scratched.values()), shard.decoded_nbytes, runs, checks)
    copies = [(at_of[key] + skip, dst, n) for key, skip, dst, n in copies]
    decodes = [(e, at_of[key], None if scale is None else at_of[scale], skip, dst, n)
               for e, key, scale, skip, dst, n in decodes]

    def consume(data: torch.Tensor) -> None:
        for src, dst, n in copies:
            data[dst: dst + n].copy_(data[src: src + n])
        for e, at, scale_at, skip, dst, n in decodes:
            scale_bytes = None if scale_at is None else data[scale_at: scale_at + -(-e["numel"] // BLOCK) * 4]
            values = decode_piece(e["dtype"], data[at: at + e["length"]], scale_bytes, e["numel"])
            data[dst: dst + n * 4].view(torch.float32).copy_(values[skip: skip + n])
        for seg, dst in zeros:
            data[dst: dst + seg.length * 4].zero_()
        for seg, dst in masters:
            data[dst: dst + seg.length * 4].view(torch.float32).copy_(view.current_values(seg))
        view.write(shard, data[: shard.decoded_nbytes].view(torch.float32).view(len(shard.names), shard.numel))

    simple = not (copies or zeros or masters or decodes) and shard.packing.plain
    return ReadItem(extra, merge_runs(runs), checks, consume, in_place=shard.overwrite_in_place if simple else None)


def _placed(pieces: list[dict], start: int, runs: list, checks: list) -> tuple[int, dict[int, int]]:
    """Place ``pieces`` in a read buffer from ``start`` on, in the file's order, pieces
    that follow each other in a file (less than a page apart) as the file holds them, so
    they are read as one range (a shard's coded rows rest as one: listed per parameter, each
    would take an aligned place of its own, two pages apiece); returns the buffer's end and
    each piece's place by id."""
    extra, at_of, last = -(-start // ALIGN) * ALIGN, {}, (None, 0)
    for e in sorted(pieces, key=lambda e: (e["file"], e["offset"])):
        gap = e["offset"] - last[1]
        if e["file"] == last[0] and 0 <= gap < ALIGN:
            extra += gap
        else:
            extra = -(-extra // ALIGN) * ALIGN + e["offset"] % ALIGN
        at_of[id(e)] = extra
        runs.append(ReadRun(e["file"], e["offset"], e["length"], extra))
        checks.append((e, extra))
        extra, last = extra + e["length"], (e["file"], e["offset"] + e["length"])
    return -(-extra // ALIGN) * ALIGN, at_of


def load_torch_optimizer(opt: torch.optim.Optimizer, manifest: dict, plan: dict, reader: BlobReader) -> None:
    info = plan["info"]
    index = {name: i for i, name in enumerate(n for names in plan["names"] for n in names)}
    state: dict[int, dict] = {}
    for name, values in info["state"].items():
        state.setdefault(index[name], {}).update(values)
    items = []
    for (name, row), entries in plan["pieces"].items():
        for entry in entries:
            def consume(data: torch.Tensor, name=name, row=row, entry=entry) -> None:
                value = tensor_of(data[: entry["length"]], dtype_of(entry["dtype"]), tuple(entry["shape"]))
                state.setdefault(index[name], {})[row] = value.clone()

            items.append(ReadItem(entry["length"], [ReadRun(entry["file"], entry["offset"], entry["length"], 0)],
                                  [(entry, 0)], consume))
    reader.run(items)
    groups, start = [], 0
    for saved, names in zip(info["param_groups"], plan["names"]):
        group = {k: v for k, v in saved.items() if k != "params"}
        group["params"] = list(range(start, start + len(names)))
        start += len(names)
        groups.append(group)
    for group, current in zip(groups, opt.param_groups):
        for key, value in group.items():
            if isinstance(current.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
    opt.load_state_dict({"state": state, "param_groups": groups})
