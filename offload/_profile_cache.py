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


def _read_cached(candidate: str, fs: int) -> dict[str, Any] | None:
    try:
        with open(candidate) as fh:
            report = json.load(fh)
        choice = report["engine_choice"]
        int(choice["block_size"]), int(choice["queue_depth"]), int(choice["threads"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the cached profile %s (%s): re-run offload-profile --path %s", candidate,
                    err, os.path.dirname(candidate))
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
