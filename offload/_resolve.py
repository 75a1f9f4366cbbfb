"""What an ``OffloadConfig`` leaves to the machine, resolved where it is needed.

``OffloadConfig`` is pure data: it never reads the file system. The settings that depend
on this machine are resolved here, by the calls that build something from a config
(``wrap``, an optimizer's own store, checkpoint streaming), each into a frozen record:

* :func:`resolve_engine` -> :class:`EngineSettings`: the file engine's block size,
  threads and queue depth: given, from the profile cached for ``nvme_path``
  (``io="auto"``), or built in; ``source`` says which;
* :func:`choose_io_backend` -> :class:`IoBackendChoice`: ``"direct"`` or ``"mmap"`` for
  ``io_backend="auto"``, and why;
* :func:`check_output_paths`: ``log_path`` and ``trace_path`` can be written.

Resolving again gives the same answer as long as the cached profile is unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import psutil

from ._os import direct_io_supported
from ._profile_cache import CachedProfile, find_profile
from ._units import format_size

if TYPE_CHECKING:
    from .config import OffloadConfig

__all__ = ["EngineSettings", "IoBackendChoice", "resolve_engine", "choose_io_backend", "check_output_paths",
           "BUILT_IN_ENGINE"]

log = logging.getLogger(__name__)
_logged_profiles: set[str] = set()


@dataclass(frozen=True)
class EngineSettings:
    """The file engine's settings for one config, and where they came from.

    ``source``: ``"given"`` (all three set in the config), ``"built-in"``, or the path of
    the cached profile the unset ones were read from.
    """

    block_size: int
    threads: int
    queue_depth: int
    source: str


# the built-in setting: 256 MiB in the kernel at once, fio's best on the reference disk
BUILT_IN_ENGINE = EngineSettings(block_size=8 << 20, threads=32, queue_depth=32, source="built-in")


class IoBackendChoice(NamedTuple):
    """How a store's NVMe bytes move (``"direct"`` or ``"mmap"``), and why."""

    backend: str
    reason: str


def resolve_engine(config: OffloadConfig) -> EngineSettings:
    """The engine settings ``config`` runs with here: the values it gives, and for the others
    those of the profile cached for its ``nvme_path`` (``io="auto"``, when a tier is on
    NVMe) or the built-in ones."""
    given = {"block_size": config.block_size, "threads": config.io_threads, "queue_depth": config.queue_depth}
    if all(value is not None for value in given.values()):
        return EngineSettings(**given, source="given")
    found = _profile_of(config) if _uses_nvme(config) else None
    fill = BUILT_IN_ENGINE
    if found is not None:
        choice = found.report["engine_choice"]
        fill = EngineSettings(int(choice["block_size"]), int(choice["threads"]), int(choice["queue_depth"]),
                              source=found.path)
    settings = EngineSettings(**{name: getattr(fill, name) if value is None else value
                                 for name, value in given.items()}, source=fill.source)
    if found is not None and found.path not in _logged_profiles:
        _logged_profiles.add(found.path)
        log.info("io='auto': file engine settings from %s (measured %s): block_size %d KiB, io_threads %d, "
                 "queue_depth %d", found.path, found.report.get("created", "?"), settings.block_size >> 10,
                 settings.threads, settings.queue_depth)
    return settings


def choose_io_backend(config: OffloadConfig, nvme_bytes: int) -> IoBackendChoice:
    """The backend for a store of ``config`` that will hold ``nvme_bytes`` on NVMe: what
    ``io_backend="auto"`` decides (a given backend is returned as is)."""
    if config.io_backend != "auto":
        return IoBackendChoice(config.io_backend, "io_backend set in the config")
    if not direct_io_supported(config.nvme_path):
        return IoBackendChoice("mmap", f"the file system of {config.nvme_path!r} refuses O_DIRECT")
    found = _profile_of(config)
    mm = (found.report.get("disk_mmap") or {}) if found else {}
    if not mm.get("warm_read_gbps"):
        return IoBackendChoice("direct", "no offload-profile measurement of mmap for this disk (run offload-profile "
                               f"--path {os.path.dirname(config.nvme_path)!r} to let auto choose by measurement)")
    direct_read = float(found.report["disk_read_gbps"])
    room = psutil.virtual_memory().available - config.host_budget
    if config.torch_device.type == "cpu":
        room -= config.device_budget
    need = f"the NVMe data ({format_size(nvme_bytes)})"
    if nvme_bytes > config.host_budget:
        return IoBackendChoice("direct", f"{need} is larger than host_budget ({format_size(config.host_budget)}): "
                                         "it would not stay cached")
    if nvme_bytes > room:
        return IoBackendChoice("direct", f"{need} is larger than the RAM left free after the budgets "
                                         f"({format_size(max(room, 0))})")
    if mm["warm_read_gbps"] <= direct_read:
        return IoBackendChoice("direct", f"warm mmap reads measured {mm['warm_read_gbps']:.2f} GB/s, not faster "
                                         f"than O_DIRECT's {direct_read:.2f} GB/s ({found.path})")
    return IoBackendChoice("mmap", f"{need} fits in host_budget and free RAM, and warm mmap reads measured "
                                   f"{mm['warm_read_gbps']:.2f} GB/s against {direct_read:.2f} GB/s O_DIRECT "
                                   f"({found.path})")


def check_output_paths(config: OffloadConfig) -> None:
    """Refuse a ``log_path`` or ``trace_path`` that cannot be written: its directory missing
    or not writable, or the path itself a directory. ``wrap`` calls it before building
    anything, so a run never fails at its first log line or at the end."""
    for name in ("log_path", "trace_path"):
        path = getattr(config, name)
        if path is None:
            continue
        parent = os.path.dirname(path)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"{name}={path!r}: the directory {parent!r} does not exist or is not writable: "
                             f"create it or set OffloadConfig({name}=...) to another path")
        if os.path.isdir(path):
            raise ValueError(f"{name}={path!r} is a directory: set OffloadConfig({name}=...) to a file name")


def _uses_nvme(config: OffloadConfig) -> bool:
    return "nvme" in (config.param_tier, config.optimizer_tier, config.activation_tier)


def _profile_of(config: OffloadConfig) -> CachedProfile | None:
    """The cached profile ``io="auto"`` reads for ``config``, or None (``io="manual"``)."""
    if config.io != "auto" or config.nvme_path is None:
        return None
    return find_profile(config.nvme_path)
