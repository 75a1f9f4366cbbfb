"""Tied parameters against a checkpoint, as ``from_pretrained`` ties them.

Note: ``from_pretrained`` ties what a transformers model's config says it ties (an output
embedding to the input embedding under ``tie_word_embeddings``) after it loads the file,
unless the file holds both names with different values. A model built on the meta device
may arrive untied: ``accelerate.init_empty_weights`` gives each name a parameter of its own
(transformers 5's ``post_init`` ties by assigning, which that context turns into a new
parameter). Loading such a model from a checkpoint that holds both names with one value
would give it two parameters where ``from_pretrained`` gives one, and training then moves
them apart, silently; it is refused with the fix instead.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["check_tied_names", "check_ties_as_loaded"]


def check_ties_as_loaded(model: nn.Module, path: str, has: Callable[[str], bool],
                         same: Callable[[str, str], bool]) -> None:
    """Refuse ``model`` where it holds apart two parameters that ``from_pretrained`` would tie
    loading the checkpoint at ``path`` (the module's note). ``has(name)``: the file holds
    it; ``same(a, b)``: the file's two tensors are one value."""
    expanded = getattr(model, "get_expanded_tied_weights_keys", None)
    # (not a transformers 5 model, or one wrapped in another that forwards its attributes, a
    # PEFT model, whose copies of tied modules are its own: its parameters are as made)
    if not callable(expanded) or getattr(expanded, "__self__", None) is not model:
        return
    try:
        pairs = expanded(all_submodels=True)
    except (AttributeError, TypeError, ValueError):  # (a model of an older layout: nothing to compare against)
        return
    for target, source in pairs.items():
        try:
            apart = model.get_parameter(target) is not model.get_parameter(source)
        except AttributeError:  # (a name the model does not have as a parameter)
            continue
        if not apart or (has(target) and has(source) and not same(target, source)):
            continue  # (tied; or the file holds two values, which from_pretrained keeps apart too)
        raise ValueError(
            f"{type(model).__name__}'s config ties {target!r} to {source!r} (tie_word_embeddings), as "
            f"from_pretrained({path!r}) would, but the model as built holds them as two parameters "
            "(accelerate.init_empty_weights builds transformers models so), and training would move them apart. "
            "Call model.tie_weights() before offload.wrap, or build the model under offload.init_empty_weights(); "
            "to keep them apart, build it with tie_word_embeddings=False in its config")


def check_tied_names(path: str, names: list[str], same: Callable[[str, str], bool]) -> None:
    """A parameter the model ties under several ``names`` the file holds: they must be the
    same tensor, or which one the model reads would decide its outputs (transformers unties
    them)."""
    for other in names[1:]:
        if not same(names[0], other):
            raise ValueError(
                f"checkpoint {path!r} holds both {names[0]!r} and {other!r}, which this model ties into one "
                "parameter, with different values: from_pretrained unties them for such a file. Build the model "
                "untied (tie_word_embeddings=False in its config, so each reads its own tensor), or save the "
                "checkpoint from the tied model")
