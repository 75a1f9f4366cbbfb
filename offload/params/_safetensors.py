"""The safetensors format, read by hand (``_loading``'s note says why not ``safe_open``):
which files make up a checkpoint, their headers checked as safetensors checks them, and
one tensor's bytes read with ``os.preadv`` into a fresh tensor."""

from __future__ import annotations

import glob
import json
import os
import struct

import torch

__all__ = ["Entry", "checkpoint_files", "load_entry", "read_header", "same_bytes"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class Entry:
    __slots__ = ("path", "dtype", "shape", "start", "end")

    def __init__(self, path: str, dtype: torch.dtype, shape: list[int], start: int, end: int):
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end


def load_entry(entry: "Entry", name: str) -> torch.Tensor:
    out = torch.empty(entry.end - entry.start, dtype=torch.uint8)
    view = memoryview(out.numpy()) if out.numel() else memoryview(bytearray())
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], entry.start + done)
            if n <= 0:
                raise ValueError(f"checkpoint file {entry.path!r} is truncated: tensor {name!r} "
                                 f"needs bytes {entry.start}-{entry.end}")
            done += n
    finally:
        os.close(fd)
    return out.view(entry.dtype).reshape(entry.shape) if out.numel() else \
        torch.empty(entry.shape, dtype=entry.dtype)


def same_bytes(a: Entry, b: Entry, chunk: int = 64 << 20) -> bool:
    if a.end - a.start != b.end - b.start:
        return False
    with open(a.path, "rb", buffering=0) as fa, open(b.path, "rb", buffering=0) as fb:
        for at in range(0, a.end - a.start, chunk):
            n = min(chunk, a.end - a.start - at)
            if os.pread(fa.fileno(), n, a.start + at) != os.pread(fb.fileno(), n, b.start + at):
                return False
    return True


def checkpoint_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The files that make up the checkpoint at ``path``, as ``from_pretrained`` picks them
    (model.safetensors, else an index, else the directory's .safetensors files), and the
    index's file for each tensor (None without an index)."""
    if os.path.isfile(path):
        return [path], None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist: give a .safetensors file, a "
                                "directory with model.safetensors(.index.json), or a save_pretrained directory")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):  # (beside it, an index, a variant, an adapter or an older copy: not the model's)
        return [single], None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = {k: os.path.join(path, f) for k, f in json.load(fh).get("weight_map", {}).items()}
        return sorted(set(weight_map.values())), weight_map
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files and os.path.exists(os.path.join(path, "manifest.json")):
        raise FileNotFoundError(
            f"{path!r} is an offload checkpoint (manifest.json), not safetensors weights: wrap the model (built "
            "with offload.init_empty_weights() it needs a checkpoint=, so build it normally or give its "
            "save_pretrained directory), then offload.load_checkpoint(path, model[, optimizer]); or load a plain "
            "model with model.load_state_dict(offload.load_state_dict_from(path))")
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path!r} (pickle .bin checkpoints are not "
                                "loaded: they can run code; convert them with save_pretrained(safe_serialization=True))")
    return files, None


def read_header(file: str) -> dict[str, Entry]:
    with open(file, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file!r} is not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", raw)
        size = os.fstat(fh.fileno()).st_size
        if length > size - 8:
            raise ValueError(f"{file!r} is not a safetensors file or is truncated (header of {length} bytes)")
        try:
            header = json.loads(fh.read(length))
        except json.JSONDecodeError as err:
            raise ValueError(f"{file!r} has a corrupt safetensors header: {err}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file!r} has a corrupt safetensors header: not a JSON object")
    return _entries(file, header, 8 + length, size)


def _entries(file: str, header: dict, base: int, size: int) -> dict[str, Entry]:
    """The header's tensors, checked as safetensors checks them before reading: each one's
    bytes match its dtype and shape, and together they tile the data section exactly, in
    order, with no overlap or gap (a shifted offset would otherwise read a neighbour's
    bytes as this tensor's)."""
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file!r} has a corrupt safetensors header: tensor {name!r} lacks a dtype, "
                             "shape or data_offsets pair") from None
        if dtype not in _DTYPES:
            raise ValueError(f"{file!r}: tensor {name!r} has unsupported dtype {dtype}")
        need = _DTYPES[dtype].itemsize
        for dim in shape:
            need *= dim
        if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != need:
            raise ValueError(f"{file!r} has a corrupt safetensors header: tensor {name!r} ({dtype} of shape "
                             f"{shape}, {need} bytes) has data_offsets [{start}, {end}]")
        if base + end > size:
            raise ValueError(f"{file!r} is truncated: tensor {name!r} ends at byte {base + end} of {size}")
        entries[name] = Entry(file, _DTYPES[dtype], shape, base + start, base + end)
    at = base
    for name, entry in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if entry.start != at:
            raise ValueError(f"{file!r} has a corrupt safetensors header: tensor {name!r} starts at data byte "
                             f"{entry.start - base}, where the tensors before it end at {at - base} (overlapping "
                             "or gapped data_offsets)")
        at = entry.end
    if at != size:
        raise ValueError(f"{file!r} has a corrupt safetensors header: its tensors end at byte {at}, the file at {size}")
    return entries
