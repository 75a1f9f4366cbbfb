"""Parameters transformers builds from several tensors of a checkpoint, built alike.

transformers 5 saves some architectures in an older layout and converts them as it loads
(``_hf_keys``): a mixture of experts' per-expert ``experts.3.gate_proj.weight`` and
``up_proj`` are stacked and joined into one ``experts.gate_up_proj``. Such a parameter is
no tensor of the file, so it is not read in place: it is built once, at wrap, by a copy
of transformers' own converter fed with the file's tensors (the same operations, in the
same order: the sources sorted as ``from_pretrained`` sorts them), and copied into the
store like any parameter converted on load. The sources are converted in the file's dtype
and cast after, where transformers casts first: the same bits for the operations that
move elements (stack, cat, split, transpose, permute), which its fusing converters use. A dry run of each converter on meta tensors
gives the parameters' shapes and dtypes up front, for the checks against the model.
Host memory holds one parameter's sources and result while it is built.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["BuiltParams"]

log = logging.getLogger(__name__)


@dataclass
class _Mapping:
    """One converter's work: the model name it is filed under, and its sources."""

    first: str  # the model name transformers files the converter under (its first target)
    converter: Any  # transformers' WeightConverter, as the model's conversion mapping holds it
    sources: list[tuple[str, str]]  # (source pattern, checkpoint key), in from_pretrained's order


class BuiltParams:
    """The model's parameters built from several checkpoint tensors (module docstring).

    ``converted``: checkpoint key -> (converter, source pattern), as ``hf_keys`` finds them;
    ``read(key)`` / ``meta(key)``: the file's tensor, and a meta tensor of its shape and dtype.
    Raises ``ValueError`` naming the converter where a dry run fails.
    """

    def __init__(self, model: nn.Module, converted: dict[str, tuple[Any, str]], names: dict[str, str],
                 read: Callable[[str], torch.Tensor], meta: Callable[[str], torch.Tensor]):
        from transformers.core_model_loading import dot_natural_key

        self._model, self._read = model, read
        self._mappings: dict[str, _Mapping] = {}
        for key in sorted(converted, key=dot_natural_key):
            converter, pattern = converted[key]
            mapping = self._mappings.setdefault(names[key], _Mapping(names[key], converter, []))
            mapping.sources.append((pattern, key))
        self.shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # model name -> (dtype, shape)
        self._of: dict[str, _Mapping] = {}  # model name -> the mapping that builds it
        for mapping in self._mappings.values():
            try:
                out = self._convert(mapping, meta)
            except Exception as err:  # (transformers' operations raise what they raise: reported, re-raised)
                raise ValueError(f"transformers' converter for {mapping.first!r} ({type(mapping.converter).__name__}"
                                 f" of {[k for _, k in mapping.sources][:3]}) failed on meta tensors: "
                                 f"{type(err).__name__}: {err}") from err
            for name, t in out.items():
                self.shapes[name] = (t.dtype, tuple(t.shape))
                self._of[name] = mapping
        self._ready: dict[str, torch.Tensor] = {}  # built along with another, not taken yet
        if self._mappings:
            log.info("%d parameters are built from %d checkpoint tensors as transformers builds them when loading "
                     "a %s (e.g. %s): copied once into the store, not read in place", len(self.shapes),
                     len(converted), type(model).__name__, next(iter(self.shapes)))

    def __contains__(self, name: str) -> bool:
        return name in self._of

    def sources(self, name: str) -> list[str]:
        return [key for _, key in self._of[name].sources]

    def take(self, name: str) -> torch.Tensor:
        """The parameter ``name`` built from the file's tensors (a fresh tensor)."""
        if name in self._ready:
            return self._ready.pop(name)
        out = self._convert(self._of[name], self._read)
        value = out.pop(name)
        self._ready.update(out)  # (the converter's other targets: asked for next, as they share a module)
        return value

    def _convert(self, mapping: _Mapping, load: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(mapping.converter)  # (it collects its tensors: one per target, as transformers)
        for pattern, key in mapping.sources:
            converter.add_tensor(mapping.first, key, pattern, functools.partial(load, key))
        out = converter.convert(mapping.first, model=self._model, config=getattr(self._model, "config", None))
        return {name: (value[0] if isinstance(value, list) else value) for name, value in out.items()}
