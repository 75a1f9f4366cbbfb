"""What transformers' ``from_pretrained`` does to a checkpoint's tensors that offload must
do alike: their names (below), and the weights it keeps in fp32 under a half dtype
(``kept_in_fp32``).

transformers 5 keeps some architectures' files in an older layout and converts them while
loading (``conversion_mapping``): some keys are only renamed (a ViT's
``attention.attention.key``), others are fused or split (a mixture of experts' per-expert
``w1``/``w3`` into one ``gate_up_proj``; some transposed or permuted under their own name).
A renamed tensor is the same bytes under another
name, so offload reads it as the model names it, in place too. A converted one is not one
tensor of the file: transformers' own converter builds it (``_hf_built``).
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["HfKeys", "hf_keys", "kept_in_fp32"]

log = logging.getLogger(__name__)


@dataclass
class HfKeys:
    """The model's name for each checkpoint key transformers renames, and the keys it
    would convert (fused or split), which no model name reads as they are."""

    renamed: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model key
    converted: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model key built from it
    converters: dict[str, tuple[Any, str]] = field(default_factory=dict)  # converted key -> (converter, pattern)


def hf_keys(model: nn.Module, keys: list[str], model_keys: set[str]) -> HfKeys | None:
    """How transformers would name ``keys`` (a checkpoint's) for ``model``, whose state
    names are ``model_keys``; None where ``model`` is not a transformers model, or this
    transformers has no conversion mapping (then names are taken as they are)."""
    if "transformers" not in sys.modules:  # (then the model is not one of its: no import of it for nothing)
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    try:
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        known: dict[str, Any] = dict.fromkeys(model_keys, True)  # (only membership is asked)
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        out = HfKeys()
        for key in keys:
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, known)
            if name not in known and key in known:  # (as from_pretrained: a key that needed no renaming)
                name, pattern = key, None
            if pattern is not None:
                out.converted[key] = name
                out.converters[key] = (by_pattern[pattern], pattern)
            elif name != key:
                out.renamed[key] = name
        return out
    except (TypeError, AttributeError, ValueError) as err:  # (another transformers' signatures)
        log.warning("transformers' checkpoint conversion mapping not applied (%s): the checkpoint's names are "
                    "taken as they are", err)
        return None


def kept_in_fp32(model: nn.Module, dtype: torch.dtype | None) -> Callable[[str], bool] | None:
    """Which parameter names ``compute_dtype`` leaves in fp32, as ``from_pretrained(dtype=)``
    keeps them: a transformers model's ``_keep_in_fp32_modules`` under fp16 (T5's ``wo``,
    whose products overflow fp16) and ``_keep_in_fp32_modules_strict`` under fp16 and bf16,
    each a pattern searched in the name (``*``: anything), as transformers matches them;
    for every such model in ``model`` (one inside a module of the user's too), over its own
    parameters. None where none is kept."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    kept: list[tuple[str, re.Pattern]] = []
    for prefix, module in model.named_modules():
        patterns = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            patterns |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        if patterns:
            found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in sorted(patterns)))
            kept.append((f"{prefix}." if prefix else "", found))
    if not kept:
        return None
    return lambda name: any(name.startswith(prefix) and found.search(name, len(prefix)) for prefix, found in kept)
