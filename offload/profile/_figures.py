"""From the disk measurements to the report's disk figures: which are recommended on,
which are a cache's or a burst's, and the spread behind each."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .._units import format_size
from ._disk import BURST_S, DiskResult, DiskSetting

__all__ = ["best", "leaders", "engine_choice", "disk_report", "figures_used"]


def figures_used(spread: dict[str, dict[str, Any]]) -> str:
    """In words, which figures the recommendation used and why (``spread``: per op, what
    :func:`disk_report` puts in ``disk_*_spread``)."""
    def how(op: str) -> str:
        s = spread[op]
        return (f"{len(s['runs'])} {op}s of {format_size(s['pass_bytes'])}, "
                + (f"each after its first {BURST_S:g} s" if s["split"] else
                   f"each whole (too short to leave out the first {BURST_S:g} s)"))

    return (f"sustained figures: the median of {how('read')} and of {how('write')}, with the chosen setting, "
            "of bytes not moved recently; not the burst, cached or best-of-sweep figures")


def _best_by_setting(results: list[DiskResult], op: str) -> dict[DiskSetting, DiskResult]:
    out: dict[DiskSetting, DiskResult] = {}
    for r in results:
        if r.op == op and (r.setting not in out or r.gbps > out[r.setting].gbps):
            out[r.setting] = r
    return out


def leaders(results: list[DiskResult], op: str, n: int) -> list[DiskSetting]:
    """The ``n`` O_DIRECT settings with the fastest ``op`` so far."""
    ranked = sorted(_best_by_setting(results, op).values(), key=lambda r: -r.gbps)
    return [r.setting for r in ranked[:n] if r.setting.direct]


def best(results: list[DiskResult], op: str) -> DiskResult:
    """The fastest ``op`` measurement, O_DIRECT ones first."""
    direct = [r for r in results if r.op == op and r.setting.direct]
    return max(direct or [r for r in results if r.op == op], key=lambda r: r.gbps)


def engine_choice(results: list[DiskResult]) -> DiskSetting:
    """The setting with the best read and write together (geometric mean), O_DIRECT first."""
    reads, writes = _best_by_setting(results, "read"), _best_by_setting(results, "write")
    both = [s for s in reads if s in writes and s.direct] or [s for s in reads if s in writes]
    return max(both, key=lambda s: math.sqrt(reads[s].gbps * writes[s].gbps))


def _setting_dict(r: DiskResult) -> dict[str, Any]:
    s = r.setting
    return {"block_size": s.block_size, "queue_depth": s.queue_depth, "threads": s.threads,
            "direct": s.direct, "gbps": round(r.gbps, 4)}


def _spread(passes: list[DiskResult]) -> dict[str, Any]:
    values = [r.sustained_gbps() for r in passes]
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "max": round(max(values), 4), "runs": [round(v, 4) for v in values],
            "split": all(r.split() for r in passes), "pass_bytes": passes[0].nbytes}


def _burst(passes: list[DiskResult]) -> float | None:
    bursts = [b for b in (r.burst_gbps() for r in passes) if b is not None]
    return round(max(bursts), 4) if bursts else None


def disk_report(results: list[DiskResult], choice: DiskSetting, first: DiskResult, passes: list[DiskResult],
                cached: list[DiskResult]) -> dict[str, Any]:
    """The report's disk keys. ``results``: the sweep; ``choice``: its :func:`engine_choice`;
    ``first``: the first write of the file; ``passes``: the sustained reads and writes
    with ``choice``; ``cached``: the re-read and the rewrite of the same bytes."""
    reads, writes = _best_by_setting(results, "read"), _best_by_setting(results, "write")
    buffered = {op: max((r.gbps for r in results if r.op == op and not r.setting.direct), default=None)
                for op in ("read", "write")}
    by_op = {op: [r for r in passes if r.op == op] for op in ("read", "write")}
    spread = {op: _spread(by_op[op]) for op in by_op}
    cached_by = {r.op: r.gbps for r in cached}
    best_read, best_write = best(results, "read"), best(results, "write")
    return {
        "disk_read_gbps": statistics.median(r.sustained_gbps() for r in by_op["read"]),
        "disk_write_gbps": statistics.median(r.sustained_gbps() for r in by_op["write"]),
        "disk_read_spread": spread["read"],
        "disk_write_spread": spread["write"],
        "disk_figures_used": figures_used(spread),
        "disk_first_write_gbps": first.sustained_gbps(),
        "disk_first_write_burst_gbps": first.burst_gbps(),
        "disk_read_burst_gbps": _burst([r for r in passes if r.op == "read"]),
        "disk_write_burst_gbps": _burst([r for r in passes if r.op == "write"]),
        "disk_burst_seconds": BURST_S,
        "disk_cached_read_gbps": cached_by.get("cached_read"),
        "disk_cached_write_gbps": cached_by.get("cached_write"),
        "disk_best_read": _setting_dict(best_read),
        "disk_best_write": _setting_dict(best_write),
        "disk_buffered_read_gbps": buffered["read"],
        "disk_buffered_write_gbps": buffered["write"],
        "engine_choice": {"block_size": choice.block_size, "queue_depth": choice.queue_depth,
                          "threads": choice.threads, "direct": choice.direct,
                          "read_gbps": reads[choice].gbps, "write_gbps": writes[choice].gbps},
        "disk_sweep": [r.to_dict() for r in results],
    }
