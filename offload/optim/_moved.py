"""What the optimizer reads from and writes to its tiers, by kind of bytes: parameters (the
host copies of groups it updates and the groups it writes back), fp32 master rows, moment
rows, gradient accumulators. ``stats`` keeps the running sums; the step log gets them per
parameter for each step (``per_parameter``), so a smaller format shows where it saves."""

from __future__ import annotations

from ._layout import Shard

__all__ = ["KINDS", "counters", "count", "count_states", "per_parameter"]

KINDS = ("parameters", "master", "moments", "gradients")


def counters() -> dict[str, int]:
    return {f"{kind}_{way}_bytes": 0 for kind in KINDS for way in ("read", "write")}


def count(stats: dict, kind: str, *, read: int = 0, written: int = 0) -> None:
    stats[f"{kind}_read_bytes"] += read
    stats[f"{kind}_write_bytes"] += written


def count_states(stats: dict, shard: Shard, *, read: bool) -> None:
    """A shard's state rows read or written whole: its master row and its moment rows."""
    master = shard.master_bytes
    way = "read" if read else "write"
    stats[f"master_{way}_bytes"] += master
    stats[f"moments_{way}_bytes"] += shard.state_bytes - master


def per_parameter(now: dict, before: dict, params: int) -> dict[str, float]:
    """Bytes read plus written per parameter, by kind, between two readings of ``stats``."""
    return {kind: round(sum(now[f"{kind}_{w}_bytes"] - before.get(f"{kind}_{w}_bytes", 0)
                            for w in ("read", "write")) / max(params, 1), 3) for kind in KINDS}
