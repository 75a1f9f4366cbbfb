"""The norms and finiteness of all the gradients an optimizer holds: from what was noted when
each accumulator was written (no pass over the tier), plus the plain parameters' ``p.grad``;
with several ranks reduced over the ranks, so every rank clips or skips alike."""

from __future__ import annotations

import math

import torch

from ._noted import held_norm
from ._shards import ShardBook

__all__ = ["total_norm", "scale_all", "found_inf"]


def _held(book: ShardBook) -> list:
    return [seg for s in book.shards if s.wrapped and s.grad_valid for seg in s.segments if seg.has_grad]


def total_norm(book: ShardBook, norm_type: float) -> float:
    """The 2-norm or inf-norm of every gradient held, in the units backward left them
    (loss-scaled, when loss scaling is on)."""
    if norm_type == 2.0 and book.partition() is None:
        return _as_torch(book)
    held = _held(book)
    # (scaled through p.grad since: as noted times the factor)
    sumsq = sum(seg.sumsq * seg.scale ** 2 for seg in held)
    maxabs = max((seg.maxabs * abs(seg.scale) for seg in held), default=0.0)
    for p in book.plain_params():
        if p.grad is not None:
            g = p.grad.detach().float()
            sumsq += float(torch.linalg.vector_norm(g)) ** 2
            maxabs = max(maxabs, float(g.abs().max())) if g.numel() else maxabs
    partition = book.partition()
    if partition is not None:  # every rank holds a slice of the gradients
        sumsq, = partition.sum([sumsq])
        maxabs, = partition.max([maxabs])
    return math.sqrt(sumsq) if norm_type == 2.0 else maxabs


def _as_torch(book: ShardBook) -> float:
    """The 2-norm as ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters
    computes it for fp32 gradients: each parameter's norm in fp32, then the norm of those.
    A parameter's norm from its noted sum of squares is torch's to the bit when it lies in
    one shard. Other dtypes are summed in fp32, and norms beyond fp32 (of a loss-scaled
    gradient) in fp64, so a loss scale never turns the total into inf."""
    norms = []
    for entry in book.entries.values():
        if entry.owner is None:
            if entry.param.grad is not None:
                norms.append(float(torch.linalg.vector_norm(entry.param.grad.detach(), dtype=torch.float32)))
            continue
        segs = [seg for seg in entry.segments if seg.has_grad and seg.shard.grad_valid]
        if segs:
            norms.append(held_norm(segs))
    if not norms:
        return 0.0
    total = float(torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32)))
    if math.isinf(total) and all(math.isfinite(n) for n in norms):
        return math.sqrt(sum(n * n for n in norms))
    return total


def scale_all(book: ShardBook, coef: float) -> None:
    """Multiply every gradient held by ``coef``: noted on the offloaded ones (applied inside
    the next step), in place on plain ``p.grad``. A segment of an accumulator still open
    (not ``grad_valid`` yet) takes the factor too: it applies when the sum is settled."""
    for seg in (seg for s in book.shards if s.wrapped for seg in s.segments if seg.has_grad):
        seg.scale *= coef
    for p in book.plain_params():
        if p.grad is not None:
            p.grad.mul_(coef)


def found_inf(book: ShardBook) -> bool:
    """Whether any gradient held has a non-finite element (on any rank)."""
    found = any(s.wrapped and s.grad_valid and not s.finite for s in book.shards)
    found = found or any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                         for p in book.plain_params())
    partition = book.partition()
    if partition is not None:  # an overflow on any rank skips the step on all of them
        found = partition.max([float(found)])[0] > 0
    return found
