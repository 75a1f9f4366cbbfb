"""Reading the profile that ``offload-profile`` cached next to the data: where it is, and
whether it still describes this disk.

Note: why this sits below ``config`` and ``profile``. Resolving ``io="auto"`` needs only
this reader; the profiler itself (which measures, and imports the optimizer to time it)
stays above, so reading a cache never pulls the measuring code in.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, NamedTuple

from ._os import nearest_existing_dir

__all__ = ["CACHE_NAME", "REPORT_VERSION", "CachedProfile", "find_profile"]

log = logging.getLogger(__name__)
_warned: set[str] = set()

CACHE_NAME = "offload-profile.json"
REPORT_VERSION = 2  # 2: disk_read_gbps / disk_write_gbps are sustained figures, not the sweep's best


class CachedProfile(NamedTuple):
    """A cached report and the file it was read from."""

    path: str
    report: dict[str, Any]


def find_profile(directory: str) -> CachedProfile | None:
    """The cached profile that describes ``directory``: its own ``offload-profile.json`` or
    that of the nearest existing parent on the same file system. A file that cannot be read,
    is from another format version or describes another file system is skipped with a
    warning."""
    current = nearest_existing_dir(directory)
    if current is None:
        return None
    fs = os.stat(current).st_dev
    while True:
        candidate = os.path.join(current, CACHE_NAME)
        if os.path.isfile(candidate):
            report = _read_cached(candidate, fs)
            if report is not None:
                return CachedProfile(candidate, report)
        parent = os.path.dirname(current)
        if parent == current or os.stat(parent).st_dev != fs:
            return None
        current = parent


# what the library reads from a cached report, and the values it can use
_ENGINE_RANGES = {"block_size": (4096, 1 << 30), "queue_depth": (1, 4096), "threads": (1, 1024)}


def _check_values(report: Any) -> None:
    """Raise ValueError (or KeyError, TypeError) for a report the library could not use."""
    if not isinstance(report, dict):
        raise ValueError(f"a JSON {type(report).__name__}, not an object")
    choice = report["engine_choice"]
    for name, (low, high) in _ENGINE_RANGES.items():
        value = choice[name]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"engine_choice.{name} {value!r} is not a whole number in [{low}, {high}]")
    figures = [("disk_read_gbps", report["disk_read_gbps"])]
    mmap = report.get("disk_mmap")
    if mmap is not None:
        if not isinstance(mmap, dict):
            raise ValueError(f"disk_mmap is a {type(mmap).__name__}, not an object")
        if mmap.get("warm_read_gbps") is not None:
            figures.append(("disk_mmap.warm_read_gbps", mmap["warm_read_gbps"]))
    for name, value in figures:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1e4:
            raise ValueError(f"{name} {value!r} is not a bandwidth in GB/s")


def _read_cached(candidate: str, fs: int) -> dict[str, Any] | None:
    try:
        with open(candidate) as fh:
            report = json.load(fh)
        _check_values(report)
    except (OSError, ValueError, KeyError, TypeError) as err:
        if candidate not in _warned:  # (asked once per store and tier: said once)
            _warned.add(candidate)
            log.warning("ignoring the cached profile %s (%s): re-run offload-profile --path %s", candidate,
                        err if not isinstance(err, KeyError) else f"{err} missing", os.path.dirname(candidate))
        return None
    if report.get("version") != REPORT_VERSION:
        log.warning("ignoring the cached profile %s: format version %s, this offload reads %d; re-run "
                    "offload-profile --path %s", candidate, report.get("version"), REPORT_VERSION,
                    os.path.dirname(candidate))
        return None
    if report.get("fs_device") != fs:
        log.warning("ignoring the cached profile %s: it was measured on another file system (device %s, "
                    "now %s); re-run offload-profile --path %s", candidate, report.get("fs_device"), fs,
                    os.path.dirname(candidate))
        return None
    return report
