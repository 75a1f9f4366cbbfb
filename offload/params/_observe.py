"""What a wrapped model reports, through its manager: ``offload.stats``, the step log
(``log_step``, ``note_step``), the timeline (``write_trace``) and the peaks' reset."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ._registry import manager_of
from ._steplog import stats_of

__all__ = ["stats", "log_step", "note_step", "write_trace", "reset_peak_stats"]


def stats(model: nn.Module) -> dict[str, Any]:
    """Bytes per tier now and at peak, bytes moved, stall seconds, prefetch hits and misses.

    ``host_bytes`` counts the runtime's host buffers; ``page_cache_bytes`` the NVMe tier's
    file pages in the kernel's page cache (``io_backend="mmap"`` keeps the recently used
    ones there, within the host budget; direct I/O leaves few), which the kernel may
    reclaim and which do not count in ``host_bytes``."""
    return stats_of(manager_of(model))


def log_step(model: nn.Module, **fields: Any) -> dict[str, Any]:
    """End a step of ``model``: returns (and, with ``OffloadConfig(log_path=...)``, appends
    as one JSON line) what moved and waited since the previous step: ``read_bytes``,
    ``write_bytes``, ``stall_seconds``, ``io_busy_seconds``, ``optimizer_seconds``,
    ``prefetch_hits``, ``prefetch_misses``, the peaks, ``page_cache_bytes`` (now),
    ``step_seconds`` (wall time since the previous line), the fields given to
    :func:`note_step` and ``fields``.

    An offloaded optimizer serving the model calls this after each ``step()``; call it
    yourself per pass for inference, or in loops with no offloaded optimizer.
    """
    return manager_of(model).steplog.record(**fields)


def note_step(model: nn.Module, **fields: Any) -> None:
    """Attach ``fields`` (e.g. ``loss=loss.item()``) to the current step's log record."""
    manager_of(model).steplog.note(**fields)


def write_trace(model: nn.Module, path: str | os.PathLike | None = None) -> str:
    """Write the recorded timeline (``OffloadConfig(trace_path=...)``) as a Chrome trace
    (open it in chrome://tracing or ui.perfetto.dev); returns the path. ``unwrap`` writes
    it too."""
    return manager_of(model).steplog.write_trace(os.fspath(path) if path is not None else None)


def reset_peak_stats(model: nn.Module) -> None:
    manager = manager_of(model)
    manager.store.reset_peaks()
    if manager.activations is not None:
        manager.activations.reset_peaks()
