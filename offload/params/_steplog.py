"""What a wrapped model reports: ``offload.stats`` (bytes per tier now and at peak, bytes
moved, waits, prefetch hits), one record per step (what moved and waited since the
previous record, appended as a JSON line to ``OffloadConfig.log_path``) and the timeline
(``OffloadConfig.trace_path``)."""

from __future__ import annotations

import json
import time
from typing import Any

from .._memory import HEAP_PEAK, breakdown
from .._trace import Tracer
from ..activations import NO_ACTIVATION_STATS

__all__ = ["StepLog", "stats_of"]

_DELTA_KEYS = ("read_bytes", "write_bytes", "stall_seconds", "io_busy_seconds", "optimizer_seconds",
               "gather_seconds", "prefetch_hits", "prefetch_misses", "demand_fetches", "act_written_bytes",
               "act_read_bytes", "act_stall_seconds", "act_small_bytes")


def stats_of(manager: Any) -> dict[str, Any]:
    """``offload.stats`` of the model ``manager`` (a ``ParamManager``) serves."""
    s = manager.store.stats()
    c = manager.coordinator.counts
    nvme = s.get("nvme", {})
    return {
        "device_bytes": s["device"]["bytes"], "device_peak_bytes": s["device"]["peak_bytes"],
        "host_bytes": s["host_pool"]["bytes"], "host_peak_bytes": s["host_pool"]["peak_bytes"],
        "nvme_bytes": nvme.get("bytes", 0), "read_bytes": nvme.get("read_bytes", 0),
        "write_bytes": nvme.get("write_bytes", 0),
        "stall_seconds": c.stall_seconds, "prefetch_hits": c.prefetch_hits,
        "prefetch_misses": c.prefetch_misses, "demand_fetches": c.demand_fetches, "groups": len(manager.groups),
        "io_busy_seconds": nvme.get("busy_seconds", 0.0), "page_cache_bytes": nvme.get("page_cache_bytes", 0),
        "optimizer_seconds": manager.steplog.optimizer_seconds,
        "gather_seconds": c.gather_seconds, "gathered_ahead": c.gathered_ahead,
        "gather_over_budget_bytes": c.gather_over_budget_bytes,
        "world_size": manager.partition.world if manager.partition is not None else 1,
        "rank": manager.partition.rank if manager.partition is not None else 0,
        # saved activations (offload.activations): moved, waited for, held
        **(NO_ACTIVATION_STATS if manager.activations is None else manager.activations.stats()),
        # the process's RSS and its parts (offload._memory); the heap's peak since the last step record
        **breakdown(HEAP_PEAK.peek()).record(),
    }


class StepLog:
    """One wrapped model's step records and timeline."""

    def __init__(self, manager: Any):
        self.manager = manager
        self.config = manager.config
        self.optimizer_seconds = 0.0  # added by each offloaded optimizer step over the model
        self.steps = 0
        self.tracer: Tracer | None = Tracer() if self.config.trace_path is not None else None
        self._noted: dict[str, Any] = {}
        self._last: dict[str, Any] | None = None
        self._last_time = time.time()

    def start(self) -> None:
        """The first step's record counts from here (not the loading at wrap)."""
        self._last, self._last_time = stats_of(self.manager), time.time()

    def note(self, **fields: Any) -> None:
        self._noted.update(fields)

    def optimizer_step_done(self, seconds: float, *, lr: float, skipped: bool, moved: dict | None = None,
                            read_in_backward: int | None = None) -> None:
        """``moved``: the bytes the optimizer read and wrote per parameter since its last
        step, by kind; ``read_in_backward``: bytes of state rows it read during the backwards."""
        self.optimizer_seconds += seconds
        self.note(lr=lr, skipped_step=skipped)
        if moved is not None:
            self.note(optimizer_bytes_per_param=moved)
        if read_in_backward is not None:
            self.note(optimizer_read_in_backward_bytes=read_in_backward)
        self.record()

    def record(self, **fields: Any) -> dict[str, Any]:
        """One step's record: what moved and waited since the previous record, the fields
        noted since then and ``fields``; appended to ``config.log_path`` when set."""
        now = time.time()
        current = stats_of(self.manager)
        previous = self._last
        record: dict[str, Any] = {"step": self.steps, "time": round(now, 3),
                                  "step_seconds": round(now - self._last_time, 6)}
        for key in _DELTA_KEYS:
            delta = current[key] - previous[key]
            record[key] = round(delta, 6) if isinstance(delta, float) else delta
        for key in ("device_peak_bytes", "host_peak_bytes", "page_cache_bytes", "act_peak_bytes",
                    "act_buffer_peak_bytes"):
            record[key] = current[key]
        memory = breakdown(HEAP_PEAK.take()).record()  # (the peak of torch's tensors over this step)
        record.update(memory)
        if self.tracer is not None:
            self.tracer.counter("memory (GiB)", {k[len("mem_"):-len("_bytes")]: round(max(v, 0) / 2**30, 3)
                                                for k, v in memory.items()
                                                if k.startswith("mem_") and k != "mem_heap_peak_bytes"})
        record.update(self._noted)
        record.update(fields)
        self._noted = {}
        self._last, self._last_time = current, now
        self.steps += 1
        if self.config.log_path is not None:
            with open(self.config.log_path, "a") as fh:
                fh.write(json.dumps(record, default=float) + "\n")
        return record

    def write_trace(self, path: str | None = None) -> str:
        target = path or self.config.trace_path
        if self.tracer is None or target is None:
            raise ValueError("no trace was recorded: wrap with OffloadConfig(trace_path='trace.json') to "
                             "record the fetch/compute/optimizer timeline")
        return self.tracer.write(target)
