"""Streaming parameters from safetensors files into the store, one tensor at a time.

Note: why not safetensors' own reader. ``safe_open`` maps the whole file, and every
page it touches stays in this process's resident set while the mapping lives, so loading
a model larger than RAM would look (and, under a cgroup limit, be) as large as the model.
The format is simple (an 8-byte header length, a JSON header, raw bytes), so tensors are
read here with ``os.preadv`` into a fresh tensor: memory holds one tensor at a time.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import logging
import os
import re
import struct
from typing import Iterator

import torch
from torch import nn

from ._hf_built import BuiltParams
from ._hf_keys import hf_keys
from ._ties import check_tied_names, check_ties_as_loaded

__all__ = ["CheckpointReader", "beside_its_config", "init_empty_weights", "take_generation_config"]

log = logging.getLogger(__name__)

# (the way round for checkpoints offload cannot read as they are: a directory, so that the
# generation defaults come with the weights, as from_pretrained takes them)
SAVE_AS_NAMED = ("save it as the model names its tensors into a new directory (safetensors.torch.save_model(model, "
                 "f'{new}/model.safetensors'), with model.config.save_pretrained(new) and, for generation, "
                 "model.generation_config.save_pretrained(new)) and wrap with checkpoint=new")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


# buffers older files saved under other names, which from_pretrained passes over where the
# model has such a buffer
_OLD_BUFFERS = (("rotary_emb.inv_freq", r"rotary_emb\.inv_freq"), ("position_ids", r"(^|\.)position_ids$"))


class _Entry:
    __slots__ = ("path", "dtype", "shape", "start", "end")

    def __init__(self, path: str, dtype: torch.dtype, shape: list[int], start: int, end: int):
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end


class CheckpointReader:
    """The tensors of a safetensors checkpoint, checked against ``model`` up front."""

    def __init__(self, path: str, model: nn.Module):
        self.path = path
        self.entries: dict[str, _Entry] = {}
        self.built: BuiltParams | dict = {}  # parameters transformers builds of several of the file's tensors
        files, weight_map = _checkpoint_files(path)
        for file in files:
            if weight_map is not None and not os.path.exists(file):
                raise FileNotFoundError(
                    f"checkpoint {path!r}: its index lists {os.path.basename(file)!r}, which is not there (a copy or "
                    "download that stopped?). Copy the missing shard in, or save the model again")
            for name, entry in _read_header(file).items():
                if weight_map is not None and weight_map.get(name, file) != file:
                    continue  # (the index names another file for it: a stale copy)
                if name in self.entries:
                    raise ValueError(f"checkpoint {path!r}: tensor {name!r} is in both {self.entries[name].path!r} "
                                     f"and {file!r}, and no index says which is the model's. Give the file itself "
                                     "as checkpoint=, or keep one model per directory (save_pretrained writes "
                                     "model.safetensors or an index)")
                self.entries[name] = entry
        self._rename_as_transformers(model)
        check_ties_as_loaded(model, path, self.has, self._same)
        self._check_against(model)

    def has(self, name: str) -> bool:
        return name in self.entries or name in self.built

    def built_from_several(self, name: str) -> bool:
        """Whether transformers builds the parameter ``name`` from several tensors of the file
        (``_hf_built``): no tensor of the file to read in place."""
        return name in self.built

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self.built.shapes[name][1]) if name in self.built else tuple(self.entries[name].shape)

    def get(self, name: str) -> torch.Tensor:
        if name in self.built:
            return self.built.take(name)
        return _load(self.entries[name], name)

    def tensor(self, slot) -> torch.Tensor:
        return self.get(self.name_of(slot))

    def name_of(self, slot) -> str:
        """The checkpoint's name for ``slot``'s parameter (tied ones have several)."""
        for name in slot.names:
            if self.has(name):
                return name
        raise KeyError(f"none of {slot.names} is in the checkpoint {self.path!r}")

    def _rename_as_transformers(self, model: nn.Module) -> None:
        """Take the model's names for the keys transformers renames when loading (the same
        bytes), and build as it does the parameters it makes of several keys (fused, split,
        transposed, permuted: ``_hf_built``)."""
        keys = hf_keys(model, list(self.entries), set(model.state_dict().keys()))
        prefix = (getattr(model, "base_model_prefix", "") or "") + "."
        self._stripped = set() if keys is None else {
            name for key, name in keys.renamed.items() if prefix != "." and key == prefix + name}
        if keys is None:
            return
        if keys.converted:
            sources = {k: self.entries.pop(k) for k in keys.converted}
            try:
                self.built = BuiltParams(model, keys.converters, keys.converted,
                                         read=lambda k: _load(sources[k], k),
                                         meta=lambda k: torch.empty(sources[k].shape, dtype=sources[k].dtype,
                                                                    device="meta"))
            except ValueError as err:
                first = sorted(keys.converted)[0]
                raise ValueError(
                    f"checkpoint {self.path!r} holds {len(keys.converted)} tensors that transformers converts when "
                    f"it loads a {type(model).__name__} (fused, split, transposed or permuted into "
                    f"{len(set(keys.converted.values()))} parameters, e.g. {first!r} into "
                    f"{keys.converted[first]!r}), and its converter could not be run here ({err}). Load the model "
                    "with from_pretrained and wrap it without checkpoint= (this needs RAM for the whole model: its "
                    "weights are then copied into swap files), or, loaded so once, " + SAVE_AS_NAMED) from err
        if keys.renamed:
            renamed = {keys.renamed.get(k, k): e for k, e in self.entries.items()}
            if len(renamed) < len(self.entries):  # (two tensors of the file under one name: which is meant?)
                counts = collections.Counter(keys.renamed.get(k, k) for k in self.entries)
                twice = sorted(k for k in self.entries if counts[keys.renamed.get(k, k)] > 1)
                raise ValueError(f"checkpoint {self.path!r}: renamed as transformers does, tensors {twice[:4]} get "
                                 "one name. Load the model with from_pretrained, then " + SAVE_AS_NAMED)
            self.entries = renamed
            first = next(iter(keys.renamed.items()))
            log.info("%d checkpoint tensors read under the names transformers gives them when loading a %s "
                     "(e.g. %s -> %s)", len(keys.renamed), type(model).__name__, *first)

    def _check_against(self, model: nn.Module) -> None:
        aliases: dict[int, list[str]] = {}
        shapes: dict[int, tuple] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
            shapes[id(param)] = tuple(param.shape)
        known = {n for names in aliases.values() for n in names}
        persistent = set(model.state_dict().keys()) - known  # persistent buffers
        missing = [names[0] for pid, names in aliases.items() if not any(self.has(n) for n in names)]
        missing += [b for b in persistent if not self.has(b) and _is_meta_buffer(model, b)]
        self._drop_ignored(model, known | persistent)
        unexpected = [k for k in self.entries if k not in known and k not in persistent]
        mismatched = []
        for pid, names in aliases.items():
            for n in names:
                if self.has(n) and self.shape_of(n) != shapes[pid]:
                    mismatched.append(f"{n}: checkpoint {self.shape_of(n)}, model {shapes[pid]}")
        problems = []
        if missing:
            problems.append(f"missing keys ({len(missing)}): {sorted(missing)[:20]}")
        if unexpected:
            problems.append(f"unexpected keys ({len(unexpected)}): {sorted(unexpected)[:20]}")
        if mismatched:
            problems.append(f"shape mismatches ({len(mismatched)}): {mismatched[:20]}")
        computed = _computed_on_load(model, missing)
        if computed and not unexpected and not mismatched and len(computed) == len(missing):
            raise ValueError(
                f"checkpoint {self.path!r} lacks {sorted(computed)[:6]}: {type(model).__name__} does not save them "
                "(_keys_to_ignore_on_save / _keys_to_ignore_on_load_missing) and computes them when from_pretrained "
                "loads it (sinusoidal position tables), which a model built on the meta device cannot. Load the "
                "model with from_pretrained(directory) and wrap it without checkpoint=, or, loaded so once, "
                + SAVE_AS_NAMED)
        if problems:
            raise ValueError(f"checkpoint {self.path!r} does not match the model: " + "; ".join(problems)
                             + ". Build the model from the config the checkpoint was saved with, as the class it "
                             "was saved from (a save_pretrained directory's config.json names it in "
                             "'architectures'). A new head on a pretrained base (a classifier the file lacks) "
                             "needs initial values offload does not make: load it with from_pretrained, which "
                             "initializes what the file lacks, and wrap it without checkpoint=.")
        for names in aliases.values():
            check_tied_names(self.path, [n for n in names if self.has(n)], self._same)

    def _drop_ignored(self, model: nn.Module, saved: set[str]) -> None:
        """Forget the file's tensors, of those the model does not save (``saved``: its state
        names), that ``from_pretrained`` passes over without a word: keys the model class
        lists as ignorable (``_keys_to_ignore_on_load_unexpected``: GPT-2's old causal
        masks), and buffers the model keeps unsaved (a rotary ``inv_freq``)."""
        patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        unsaved = {n for n, _ in model.named_buffers()}
        for buffer, pattern in _OLD_BUFFERS:
            if any(n.endswith(buffer) for n in unsaved):  # (older files kept them per layer, or saved them)
                patterns.append(re.compile(pattern))
        head = self._head_keys(model, saved)
        ignored = [k for k in self.entries if k not in saved and (k in unsaved or k in head
                                                                   or any(p.search(k) for p in patterns))]
        for k in ignored:
            del self.entries[k]
        if ignored:
            log.info("checkpoint %r: %d tensors not read, as from_pretrained does not read them (buffers the "
                     "model does not save, or keys %s ignores; e.g. %s)", self.path, len(ignored),
                     type(model).__name__, ignored[0])

    def _head_keys(self, model: nn.Module, saved: set[str]) -> set[str]:
        """A base model (``LlamaModel``) given its task model's checkpoint
        (``LlamaForCausalLM``'s, whose base weights are under ``base_model_prefix``): the
        file's tensors outside the prefix are the head's, which from_pretrained leaves
        unread, as here."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        if not prefix or any(k.startswith(prefix + ".") for k in saved) or not self._stripped:
            return set()
        return {k for k in self.entries if k not in saved and not k.startswith(prefix + ".")
                and k not in self._stripped}

    def _same(self, a: str, b: str) -> bool:
        if a in self.built or b in self.built:  # (built apart: compared as built)
            return torch.equal(self.get(a), self.get(b))
        x, y = self.entries[a], self.entries[b]
        return (x.dtype, x.shape) == (y.dtype, y.shape) and _same_bytes(x, y)


def _load(entry: "_Entry", name: str) -> torch.Tensor:
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


def beside_its_config(model: nn.Module, file: str) -> str | None:
    """The directory of a single-file checkpoint when it also holds the model's config
    (a ``config.json`` of the same ``model_type``): its generation settings are the model's.
    A folder of unrelated files gives none (None)."""
    folder = os.path.dirname(os.path.abspath(file))
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    mine = getattr(getattr(model, "config", None), "model_type", None)
    return folder if saved is not None and saved == mine else None


def take_generation_config(model: nn.Module, path: str | None) -> None:
    """A save_pretrained directory's ``generation_config.json`` becomes the model's
    generation defaults, as ``from_pretrained`` makes it (a model built from its config has
    the config's defaults instead, and ``generate`` would sample, stop and penalise
    differently); a model whose defaults were already changed keeps them."""
    if path is None:
        return
    file = os.path.join(path, "generation_config.json")
    current = getattr(model, "generation_config", None)
    if current is None or not os.path.isfile(file) or not callable(getattr(model, "can_generate", None)) \
            or not model.can_generate():
        return
    from transformers import GenerationConfig

    if current != GenerationConfig.from_model_config(model.config):
        log.info("the model's own generation settings are kept; %s is not applied", file)
        return
    model.generation_config = GenerationConfig.from_pretrained(path)
    log.info("generation settings taken from %s, as from_pretrained takes them", file)


def _computed_on_load(model: nn.Module, missing: list[str]) -> list[str]:
    """Of ``missing``, the keys the model's class says it does not save or may lack."""
    patterns = [re.compile(p) for attr in ("_keys_to_ignore_on_save", "_keys_to_ignore_on_load_missing")
                for p in (getattr(model, attr, None) or ())]
    return [k for k in missing if any(p.search(k) for p in patterns)]


def _is_meta_buffer(model: nn.Module, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    buf = model.get_submodule(module_name)._buffers.get(attr) if module_name or attr else None
    return buf is not None and buf.device.type == "meta"


def _same_bytes(a: _Entry, b: _Entry, chunk: int = 64 << 20) -> bool:
    if a.end - a.start != b.end - b.start:
        return False
    with open(a.path, "rb", buffering=0) as fa, open(b.path, "rb", buffering=0) as fb:
        for at in range(0, a.end - a.start, chunk):
            n = min(chunk, a.end - a.start - at)
            if os.pread(fa.fileno(), n, a.start + at) != os.pread(fb.fileno(), n, b.start + at):
                return False
    return True


def _checkpoint_files(path: str) -> tuple[list[str], dict[str, str] | None]:
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


def _read_header(file: str) -> dict[str, _Entry]:
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


def _entries(file: str, header: dict, base: int, size: int) -> dict[str, _Entry]:
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
        entries[name] = _Entry(file, _DTYPES[dtype], shape, base + start, base + end)
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


# In-place ops and initializers that only set values: on a meta tensor they do nothing but
# cost the Python reference kernels' time (GPT-2 1.5B's initializers: 0.75 s of a 1 s
# build). Known by name: transformers swaps torch.nn.init's functions for its own.
_VALUES_ONLY = frozenset((
    "normal_", "uniform_", "fill_", "zero_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_",
    "clamp_min_", "clamp_max_", "erfinv_", "exponential_", "random_", "bernoulli_", "log_normal_",
    "cauchy_", "geometric_", "masked_fill_", "fmod_", "abs_", "neg_", "sqrt_", "exp_", "log_",
    "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"))


class _SkipMetaValues(torch.overrides.TorchFunctionMode):
    """Skips value-only in-place ops on meta tensors (initializers of parameters that the
    checkpoint will fill): the shapes and dtypes they leave are the ones they found. What
    such an op would raise on a meta tensor (a shape mismatch) is not raised."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _VALUES_ONLY:
            # (torch.nn.init passes its tensor by keyword)
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build a model with parameters on the meta device and buffers real.

    Buffers computed at construction (rotary frequencies, attention masks) are often not
    saved in checkpoints, so they must not be lost to the meta device. Initializers and
    in-place ops that only set a meta tensor's values are skipped: there are no values to
    set. Every op in the block passes through that check, so build the model here and wrap
    it outside.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        with _SkipMetaValues():
            yield
    finally:
        nn.Module.register_parameter = original
