"""Streaming parameters from safetensors files into the store, one tensor at a time.

Note: why not safetensors' own reader. ``safe_open`` maps the whole file, and every
page it touches stays in this process's resident set while the mapping lives, so loading
a model larger than RAM would look (and, under a cgroup limit, be) as large as the model.
The format is simple (an 8-byte header length, a JSON header, raw bytes), so tensors are
read here with ``os.preadv`` into a fresh tensor: memory holds one tensor at a time.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re

import torch
from torch import nn

from ._hf_built import BuiltParams
from ._hf_keys import hf_keys
from ._safetensors import Entry, checkpoint_files, load_entry, read_header, same_bytes
from ._ties import check_tied_names, check_ties_as_loaded

__all__ = ["CheckpointReader", "beside_its_config", "take_generation_config"]

log = logging.getLogger(__name__)

# (the way round for checkpoints offload cannot read as they are: a directory, so that the
# generation defaults come with the weights, as from_pretrained takes them)
SAVE_AS_NAMED = ("save it as the model names its tensors into a new directory (safetensors.torch.save_model(model, "
                 "f'{new}/model.safetensors'), with model.config.save_pretrained(new) and, for generation, "
                 "model.generation_config.save_pretrained(new)) and wrap with checkpoint=new")

# buffers older files saved under other names, which from_pretrained passes over where the
# model has such a buffer
_OLD_BUFFERS = (("rotary_emb.inv_freq", r"rotary_emb\.inv_freq"), ("position_ids", r"(^|\.)position_ids$"))


class CheckpointReader:
    """The tensors of a safetensors checkpoint, checked against ``model`` up front."""

    def __init__(self, path: str, model: nn.Module):
        self.path = path
        self.entries: dict[str, Entry] = {}
        self.built: BuiltParams | None = None  # parameters transformers builds of several of the file's tensors
        files, weight_map = checkpoint_files(path)
        for file in files:
            if weight_map is not None and not os.path.exists(file):
                raise FileNotFoundError(
                    f"checkpoint {path!r}: its index lists {os.path.basename(file)!r}, which is not there (a copy or "
                    "download that stopped?). Copy the missing shard in, or save the model again")
            for name, entry in read_header(file).items():
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
        return name in self.entries or self.built_from_several(name)

    def built_from_several(self, name: str) -> bool:
        """Whether transformers builds the parameter ``name`` from several tensors of the file
        (``_hf_built``): no tensor of the file to read in place."""
        return self.built is not None and name in self.built

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self.built.shapes[name][1]) if self.built_from_several(name) else tuple(self.entries[name].shape)

    def get(self, name: str) -> torch.Tensor:
        if self.built_from_several(name):
            return self.built.take(name)
        return load_entry(self.entries[name], name)

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
                                         read=lambda k: load_entry(sources[k], k),
                                         meta=lambda k: torch.empty(sources[k].shape, dtype=sources[k].dtype,
                                                                    device="meta"))
            except ValueError as err:
                first = sorted(keys.converted)[0]
                raise ValueError(
                    f"checkpoint {self.path!r} holds {len(keys.converted)} tensors that transformers converts when "
                    f"it loads a {type(model).__name__} (fused, split, transposed or permuted into "
                    f"{len(set(keys.converted.values()))} parameters, e.g. {first!r} into "
                    f"{keys.converted[first]!r}), and its converter failed on them ({err}). Where the file lacks "
                    "one of them or holds one of another shape (a damaged or partly copied checkpoint), "
                    "from_pretrained fails on it too: copy or save it again. Where from_pretrained loads it, load "
                    "the model so and wrap it without checkpoint= (this needs RAM for the whole model: its weights "
                    "are then copied into swap files), or, loaded so once, " + SAVE_AS_NAMED) from err
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
        computed = _computed_onload_entry(model, missing)
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
        if self.built_from_several(a) or self.built_from_several(b):  # (built apart: compared as built)
            return torch.equal(self.get(a), self.get(b))
        x, y = self.entries[a], self.entries[b]
        return (x.dtype, x.shape) == (y.dtype, y.shape) and same_bytes(x, y)


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


def _computed_onload_entry(model: nn.Module, missing: list[str]) -> list[str]:
    """Of ``missing``, the keys the model's class says it does not save or may lack."""
    patterns = [re.compile(p) for attr in ("_keys_to_ignore_on_save", "_keys_to_ignore_on_load_missing")
                for p in (getattr(model, attr, None) or ())]
    return [k for k in missing if any(p.search(k) for p in patterns)]


def _is_meta_buffer(model: nn.Module, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    buf = model.get_submodule(module_name)._buffers.get(attr) if module_name or attr else None
    return buf is not None and buf.device.type == "meta"


