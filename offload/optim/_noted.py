"""A gradient segment's noted norms: the squared 2-norm and the max-norm taken when its
sum was written (``_sink``, ``_grads``, ``_pipeline``), from which p.grad's norms, the clip's
total and an overflow check are answered without a pass over the tier (``_norms``)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["held_norm", "noted_norms", "renote"]


def held_norm(segs: list) -> float:
    """The 2-norm of the gradient ``segs`` (one parameter's) hold, from their noted squared
    sums and factors, in the units backward left it (loss-scaled, when loss scaling is on).
    A split parameter's comes from its whole gradient's sum where that was noted and the
    sum is still that gradient (one backward since its gradient was dropped)."""
    whole = segs[0].whole if len(segs) > 1 else None
    if whole is not None and all(seg.whole is not None and seg.scale == segs[0].scale for seg in segs):
        return math.sqrt(whole * segs[0].scale ** 2)
    return math.sqrt(sum(seg.sumsq * seg.scale ** 2 for seg in segs))


def noted_norms(part: torch.Tensor) -> tuple[float, float]:
    """The squared 2-norm and the max-norm of fp32 ``part``. The fp32 sum of squares
    overflows for elements above ~1e19 (gradients of a loss scaled by 2**64, which a
    GradScaler reaches on fp32 gradients): then it is summed again in fp64."""
    if not part.numel():
        return 0.0, 0.0
    # (torch's vector_norm, as clip_grad_norm_ computes it: its cascaded sum is ~100x closer
    # than a plain dot over millions of elements)
    sumsq = float(torch.linalg.vector_norm(part)) ** 2
    # (aminmax: one pass, 8x faster here than vector_norm(part, inf); NaN propagates)
    low, high = (float(v) for v in torch.aminmax(part))
    maxabs = math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)
    if math.isinf(sumsq) and math.isfinite(maxabs):
        sumsq = float(torch.linalg.vector_norm(part, dtype=torch.float64)) ** 2
    return sumsq, maxabs


def renote(shard: Any) -> None:
    """The shard's noted norm and finiteness from its segments'."""
    held = [seg for seg in shard.segments if seg.has_grad]
    shard.sumsq = sum(seg.sumsq for seg in held)
    shard.maxabs = max((seg.maxabs for seg in held), default=0.0)
    shard.finite = math.isfinite(shard.maxabs)
