"""Every buffer pool of the process, for ``pool_bytes()``: what ``offload.stats`` counts of
offload's own memory in the process's RSS, pool by pool, and the buffers a pool left to
the tensors still viewing them (``BufferPool`` does not reuse those; they stay mapped,
outside its budget, until their last view goes)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["register", "leave", "pool_bytes"]

_POOLS: weakref.WeakSet = weakref.WeakSet()  # every BufferPool made
_LOCK = threading.Lock()
_LEFT: dict[str, int] = {}  # pool name -> bytes of buffers left to the tensors viewing them, still mapped


def register(pool: Any) -> None:
    with _LOCK:
        _POOLS.add(pool)


def leave(name: str, nbytes: int, mapping: Any) -> None:
    """``nbytes`` of pool ``name``, in ``mapping``, are left to the tensors viewing them:
    counted until the mapping goes with its last view."""
    with _LOCK:
        _LEFT[name] = _LEFT.get(name, 0) + nbytes
    weakref.finalize(mapping, _gone, name, nbytes)


def _gone(name: str, nbytes: int) -> None:
    with _LOCK:
        _LEFT[name] -= nbytes


def pool_bytes() -> dict[str, int]:
    """Bytes held now by every open buffer pool of this process, summed by pool name
    ("host", "device", "checkpoint", ...), which ``offload.stats`` counts in the process's
    RSS: resident memory, each buffer faulted in when made, or (a pool with
    ``fault_in=False``) once its first use has written it. Buffers left to views are
    counted under "<name> (left to views)"."""
    out: dict[str, int] = {}
    with _LOCK:
        pools = list(_POOLS)
        left = dict(_LEFT)
    for pool in pools:
        if not pool.closed:
            out[pool.name] = out.get(pool.name, 0) + pool.held_bytes
    for name, nbytes in left.items():
        if nbytes:
            out[f"{name} (left to views)"] = nbytes
    return out
