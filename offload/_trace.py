"""What the runtime did and when: a Chrome trace of transfers, compute and optimizer work,
and a per-step JSON-lines log.

Trace (``OffloadConfig(trace_path=...)``): the store records every transfer between tiers
as an async span from issue to completion: category ``fetch`` for loads into the device
(compute) tier, ``transfer`` for the others (write-backs, optimizer states); the parameter coordinator records each module's compute span (a group
materialized until released) and each wait for a group that was not there yet (``stall``);
the optimizer records each shard's read, update and write-back. ``Tracer.write`` produces
the Trace Event Format that ``chrome://tracing`` and https://ui.perfetto.dev open.
``overlap_seconds`` measures, from the same timeline, how long transfers ran while compute
did: the test of the prefetcher's worth.

Step log (``OffloadConfig(log_path=...)``): one JSON object per line, written after each
step of an offloaded optimizer (or at each ``offload.log_step(model)``), with what moved and
waited since the previous line: see :func:`offload.log_step`.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from typing import Any

__all__ = ["Tracer", "overlap_seconds", "busy_seconds"]


class Tracer:
    """Timestamped events, thread-safe, in memory until written."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def span(self, name: str, cat: str, start: float, end: float, track: str,
             args: dict[str, Any] | None = None) -> None:
        """A finished span on ``track`` (a row of the viewer)."""
        event = {"name": name, "cat": cat, "ph": "X", "ts": self._us(start), "dur": self._us(end) - self._us(start),
                 "pid": self._pid, "tid": track}
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    def counter(self, name: str, values: dict[str, float]) -> None:
        """A sample of counters drawn as stacked areas (the step's memory breakdown)."""
        event = {"name": name, "cat": "memory", "ph": "C", "ts": self._us(time.perf_counter()), "pid": self._pid,
                 "args": values}
        with self._lock:
            self.events.append(event)

    def begin(self, name: str, cat: str, args: dict[str, Any] | None = None) -> int:
        """Start an async span (may overlap others); returns its id for :meth:`end`."""
        ident = next(self._ids)
        self._async("b", ident, name, cat, args)
        return ident

    def end(self, ident: int, name: str, cat: str, args: dict[str, Any] | None = None) -> None:
        self._async("e", ident, name, cat, args)

    def _async(self, phase: str, ident: int, name: str, cat: str, args: dict[str, Any] | None) -> None:
        event = {"name": name, "cat": cat, "ph": phase, "ts": self._us(time.perf_counter()), "pid": self._pid,
                 "tid": cat, "id": ident}
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    def write(self, path: str) -> str:
        """Write the trace (Trace Event Format JSON) atomically; returns the path."""
        with self._lock:
            events = list(self.events)
        path = os.path.abspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"producer": "offload"}}, fh)
        os.replace(tmp, path)
        return path


def _intervals(events: list[dict[str, Any]], cat: str) -> list[tuple[float, float]]:
    """(start, end) in microseconds of the spans of category ``cat`` (sync or async)."""
    out: list[tuple[float, float]] = []
    opened: dict[int, float] = {}
    for e in events:
        if e.get("cat") != cat:
            continue
        if e["ph"] == "X":
            out.append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] == "b":
            opened[e["id"]] = e["ts"]
        elif e["ph"] == "e" and e["id"] in opened:
            out.append((opened.pop(e["id"]), e["ts"]))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_seconds(events: list[dict[str, Any]], a: str = "fetch", b: str = "compute") -> float:
    """Seconds during which some span of category ``a`` and some span of ``b`` both ran."""
    x, y = _union(_intervals(events, a)), _union(_intervals(events, b))
    total, j = 0.0, 0
    for start, end in x:
        while j < len(y) and y[j][1] <= start:
            j += 1
        k = j
        while k < len(y) and y[k][0] < end:
            total += min(end, y[k][1]) - max(start, y[k][0])
            k += 1
    return total / 1e6


def busy_seconds(events: list[dict[str, Any]], cat: str) -> float:
    return sum(end - start for start, end in _union(_intervals(events, cat))) / 1e6
