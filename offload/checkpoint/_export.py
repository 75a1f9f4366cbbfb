"""export: the model's weights as standard safetensors shards (+ index), streamed."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import struct
import tempfile
import time

from torch import nn

from .._units import format_size, parse_size
from ._catalog import Tensorish, catalog, host_bytes
from ._format import check_writable, dtype_name, fsync_dir
from ._stream import progress

__all__ = ["export"]

log = logging.getLogger(__name__)


def export(model: nn.Module, path: str | os.PathLike, format: str = "safetensors", shard_size: int | str = "5GiB") -> list[str]:
    """Write ``model``'s parameters and persistent buffers to the directory ``path`` as
    safetensors shards of at most ``shard_size`` (with ``model.safetensors.index.json`` when
    there are several), the layout ``transformers``' ``from_pretrained`` reads; a
    transformers model's ``config.json`` (and generation config) is written too. A diffusers
    model's files are named as its ``save_pretrained`` names them
    (``diffusion_pytorch_model.safetensors``), with its ``config.json``.

    Weights stream a parameter group at a time from wherever they rest, so host memory
    holds one group, not the model. Tied parameters are written once, under the name the
    model registers first (as ``save_pretrained`` does). Each file appears atomically
    (written under a temporary name, fsynced, renamed); the index is written last, and an
    earlier export's files in ``path`` are removed only then, so a failed or killed export
    leaves the earlier one loadable.
    Returns the paths written.

    With several ranks every rank calls it with the same ``path`` (on a file system they
    all see): rank 0 creates the files, each rank writes the elements its slices hold into
    them, and rank 0 puts them in place once every rank has written.
    """
    path = os.fspath(path)
    if format != "safetensors":
        raise ValueError(f"export format {format!r} is not supported: use format='safetensors'")
    limit = parse_size(shard_size, name="shard_size")
    if limit <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size!r}")
    started = time.perf_counter()
    path = os.path.abspath(path)
    cat = catalog(model)
    part = cat.manager.partition if cat.manager is not None else None
    lead = part is None or part.rank == 0
    tensors = cat.all()
    shards: list[list[Tensorish]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    stem = _stem(model)
    names = [f"{stem}.safetensors"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index_name = f"{stem}.safetensors.index.json"
    where: dict[int, tuple[int, int]] = {}  # id(Tensorish) -> (file index, byte offset)
    fds = []
    try:
        if lead:
            check_writable(path)
            os.makedirs(path, exist_ok=True)
            for stale in glob.glob(os.path.join(glob.escape(path), f"{stem}*.safetensors*.tmp")):
                os.remove(stale)  # (a killed export's; an earlier export's files stay until this one is whole)
        headers = []
        for i, (name, members) in enumerate(zip(names, shards)):
            header, at = {}, 0
            for t in members:
                header[t.name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                                  "data_offsets": [at, at + t.nbytes]}
                at += t.nbytes
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            headers.append(raw)
            base = 8 + len(raw)
            for t in members:
                where[id(t)] = (i, base + header[t.name]["data_offsets"][0])
        if lead:
            for name, raw in zip(names, headers):
                fd = os.open(os.path.join(path, name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                _pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        if part is not None:  # the files exist before another rank opens them
            _agree(part, None)
            if not lead:
                for name in names:
                    file = os.path.join(path, name + ".tmp")
                    if not os.path.exists(file):
                        raise FileNotFoundError(
                            f"rank {part.rank} does not see {file!r}, which rank 0 created: export to a "
                            "path on a file system every rank sees (a shared mount)")
                    fds.append(os.open(file, os.O_WRONLY))
        _stream(cat, tensors, where, fds, lead)
        for fd in fds:
            os.fsync(fd)
            os.close(fd)
        fds = []
        if part is not None:  # every rank has written its elements
            _agree(part, None)
        if lead:
            index = os.path.join(path, index_name)
            if n > 1 and os.path.exists(index) and any(os.path.exists(os.path.join(path, m)) for m in names):
                os.remove(index)  # (shards renamed over an earlier export's: killed midway, none loads, not a mix)
            for name in names:
                os.rename(os.path.join(path, name + ".tmp"), os.path.join(path, name))
    except BaseException as err:
        for fd in fds:
            os.close(fd)
        if part is not None and not isinstance(err, _PeerFailed):
            _agree(part, err)  # tells the others, who then raise too
        if lead:
            for name in names:
                if os.path.exists(os.path.join(path, name + ".tmp")):
                    os.remove(os.path.join(path, name + ".tmp"))
        raise
    if not lead:
        return [os.path.join(path, name) for name in names] + \
            ([os.path.join(path, index_name)] if n > 1 else [])
    written = [os.path.join(path, name) for name in names]
    total = sum(t.nbytes for t in tensors)
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: names[i] for i, members in enumerate(shards) for t in members}}
        tmp = os.path.join(path, index_name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(index, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, os.path.join(path, index_name))
        written.append(os.path.join(path, index_name))
    for stale in set(glob.glob(os.path.join(glob.escape(path), f"{stem}*.safetensors*"))) - set(written):
        os.remove(stale)  # an earlier export's other shards or index, now that this one is whole
    _save_configs(model, path)
    fsync_dir(path)
    seconds = time.perf_counter() - started
    log.info("exported %s in %d file(s) to %s in %.2f s", format_size(total), n, path, seconds)
    return written


def _diffusers(model: nn.Module) -> bool:
    """A diffusers model: its config is a plain mapping that the model itself saves
    (``ConfigMixin.save_config``), where a transformers config saves itself."""
    return callable(getattr(model, "save_config", None)) and \
        not hasattr(getattr(model, "config", None), "save_pretrained")


def _stem(model: nn.Module) -> str:
    """The weights files' name, as the library's ``from_pretrained`` looks for them."""
    return "diffusion_pytorch_model" if _diffusers(model) else "model"


def _save_configs(model: nn.Module, path: str) -> None:
    """The model's ``config.json`` (and generation config) as ``save_pretrained`` writes them,
    each made whole in a scratch directory beside it and renamed over the earlier one: a
    process killed while writing leaves the earlier export's config, not an empty file."""
    saves = [c.save_pretrained for c in (getattr(model, a, None) for a in ("config", "generation_config"))
             if c is not None and hasattr(c, "save_pretrained")]
    if _diffusers(model):
        saves.append(model.save_config)
    if not saves:
        return
    scratch = tempfile.mkdtemp(prefix=".config-", dir=path)
    try:
        for save in saves:
            save(scratch)
        for name in os.listdir(scratch):
            with open(os.path.join(scratch, name), "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(os.path.join(scratch, name), os.path.join(path, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _agree(part, error: BaseException | None) -> None:
    """A meeting point of every rank: raises on each rank when any rank came with an error
    (which then raises its own)."""
    errors = [e for e in part.gather_objects(None if error is None else f"rank {part.rank}: {error}") if e]
    if errors and error is None:
        raise _PeerFailed("export failed on another rank: " + "; ".join(errors))


class _PeerFailed(RuntimeError):
    """Another rank failed; it has told every rank already."""


def _stream(cat, tensors: list[Tensorish], where: dict, fds: list[int], lead: bool = True) -> None:
    """Write the tensors' bytes at their places; with several ranks, each rank its slices'
    elements (and rank 0 the buffers)."""
    manager = cat.manager
    bar = progress(sum(t.nbytes for t in tensors), "export")
    pool = manager.store.staging if manager is not None else None
    try:
        members: dict[int, list[Tensorish]] = {}
        for t in tensors:
            if t.group is not None:
                members.setdefault(id(t.group), []).append(t)
        for t in tensors:
            if t.group is None:
                if not lead:
                    continue
                data = host_bytes(t.tensor)
                i, offset = where[id(t)]
                _pwrite(fd=fds[i], data=memoryview(data.numpy()) if data.numel() else b"", offset=offset)
                if bar is not None:
                    bar.update(t.nbytes)
                continue
            if id(t.group) not in members:
                continue  # written with an earlier tensor of its group
            group = t.group
            buf = pool.acquire(group.nbytes)
            try:
                t.manager.store.read_into(group.key, buf.bytes).wait()
                for member in members.pop(id(group)):
                    slot = member.slot
                    if not slot.count:
                        continue
                    i, offset = where[id(member)]
                    begin, end = slot.held
                    view = buf.bytes[begin: end]
                    _pwrite(fds[i], memoryview(view.numpy()), offset + slot.first * slot.dtype.itemsize)
            finally:
                pool.release(buf)
            if bar is not None:
                bar.update(group.nbytes)
    finally:
        if bar is not None:
            bar.close()


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)

