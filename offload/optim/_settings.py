"""A step's copy of its parameter groups' settings (learning rate, betas ...), for an update
that runs after the caller may change them: in the next forward (``_deferred``), or from a
backward's first shard to the ``step()`` that ends it (``_early``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["copy_settings", "same_setting"]


def copy_settings(groups: list[dict]) -> list[dict[str, Any]]:
    """Each group's settings as values of their own (a scheduler may change a tensor or a
    list in place next); ``params`` is kept as the group's own list."""
    return [{k: v if k == "params" else _copy(v) for k, v in g.items()} for g in groups]


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - a setting that cannot be copied is kept (and compared) as the object itself
        return value


def same_setting(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # (an array's == is elementwise: no one answer)
        return a is b
