"""The whole profile: disk sweep, buffered rows, host copy, CPU AdamW, CUDA links."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
from typing import Any, Callable

import psutil
import torch

from .._os import ram_file_system
from .._profile_cache import CACHE_NAME, REPORT_VERSION, find_profile
from .._units import format_size
from ._disk import DiskProbe, DiskResult, DiskSetting, remove_stale_test_files, sweep_grid
from ._figures import best, disk_report, engine_choice, leaders

__all__ = ["run_profile", "check_target", "save_report", "planned_steps", "CACHE_NAME", "REPORT_VERSION"]

log = logging.getLogger(__name__)

_RUNTIME_DEFAULT = DiskSetting(8 << 20, 32, 32)  # the runtime's built-in engine setting
_RETRIES = 3  # the best settings of each op are measured again this many times in all
_SECONDS_PER_MEASUREMENT = {"quick": 0.4, "full": 0.6}  # of the sweep: it ranks settings
_PASSES, _PASS_SECONDS = 3, 3.0  # the sustained passes the recommendation uses
_VALIDATE_MIN = 64 << 20  # two of its 32 MiB tensors


def check_target(path: str, size: int, device: str, *, validate: int | None = None) -> torch.device:
    """Refuse, before touching anything, what cannot be profiled; returns the device."""
    path = os.path.abspath(path)
    fix = "give --path an existing directory on the disk the runtime will use"
    if not os.path.exists(path):
        raise FileNotFoundError(f"--path {path!r} does not exist: {fix} (create it first)")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"--path {path!r} is a file, not a directory: {fix}")
    probe = os.path.join(path, f".offload-profile-{os.getpid()}-probe.tmp")
    try:  # really create a file: a mode check misses read-only mounts and special file systems
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as err:
        raise PermissionError(f"--path {path!r} is not writable by this user ({err.strerror}): {fix}, or "
                              "fix its permissions") from None
    if size < 64 << 20:
        raise ValueError(f"--size {format_size(size)} is too small to measure a disk: use at least 64MiB "
                         "(the default 12GiB gets past larger caches)")
    if validate is not None and validate < _VALIDATE_MIN:
        raise ValueError(f"--validate {format_size(validate)} is too small: use at least "
                         f"{format_size(_VALIDATE_MIN)} (the default 6GiB gets past the caches the profile "
                         "gets past)")
    free = shutil.disk_usage(path).free
    in_ram = ram_file_system(path)
    if in_ram is not None:  # (its test file takes RAM; its figures are memory's)
        log.warning("--path %r is on %s, held in RAM, not on a disk: the 'disk' figures will measure memory",
                    path, in_ram)
        free = min(free, psutil.virtual_memory().available // 2)
    # the test file is removed before the validation's swap files are made
    for flag, need in (("--size", size), ("--validate", validate or 0)):
        if free < need + (64 << 20):
            raise OSError(f"--path {path!r} has {format_size(free)} free"
                          + (f" (half the RAM available: {in_ram} holds files in RAM)" if in_ram else "")
                          + f", less than {flag} {format_size(need)} "
                          f"plus 64 MiB of headroom: free space there or pass a smaller {flag}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but CUDA is not available here (torch "
                               f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'} "
                               "CUDA): use --device cpu, or install a CUDA build of torch")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise ValueError(f"--device {device!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    return dev


def run_profile(path: str | os.PathLike, size: int, *, device: str = "cpu", mode: str = "quick",
                progress: Callable[[str], None] | None = None, cache: bool = True,
                fio: bool = False, validate: int | None = None) -> dict[str, Any]:
    """Measure the disk at ``path`` (through offload's file engine), host memory, the CPU
    optimizer and, on CUDA, the host-device link. Returns the report (see the keys in
    ``docs/profile.md``) and, with ``cache``, saves it as ``path/offload-profile.json``,
    where ``OffloadConfig(io="auto")`` finds it. With ``fio`` (and fio installed), fio
    measures the best read and write settings again, as the yardstick of the table's share
    column. With ``validate`` (bytes), offload's store then moves that many bytes of
    distinct tensors with the chosen setting, and the report's ``validation`` holds what it
    achieved against the profile's figures."""
    path = os.path.abspath(os.fspath(path))
    dev = check_target(path, size, device, validate=validate)
    started = time.perf_counter()
    note = progress or (lambda label: None)
    for stale in remove_stale_test_files(path):
        log.info("removed %s, left by a profiler run that did not finish", stale)

    report: dict[str, Any] = {
        "version": REPORT_VERSION, "path": path, "fs_device": os.stat(path).st_dev,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode, "size": size,
        "device": str(dev), "host": _host_facts(), "torch": torch.__version__,
    }
    grid = sweep_grid(mode)
    with DiskProbe(path, size, time_per_measurement=_SECONDS_PER_MEASUREMENT[mode]) as probe:
        note("disk: first write (new extents)")
        first = probe.first_write(_RUNTIME_DEFAULT)
        for setting in grid:
            for op in ("write", "read"):
                note(f"disk {op}: {setting.label()}")
                probe.measure(op, setting)
        # the leaders of each op again, interleaved, so one lucky or unlucky run decides less
        for _ in range(_RETRIES - 1):
            for op in ("write", "read"):
                for setting in leaders(probe.results, op, 3):
                    note(f"disk {op} again: {setting.label()}")
                    probe.measure(op, setting)
        choice = engine_choice(probe.results)
        passes, cached = _sustained(probe, choice, first, note)
        best_read = best(probe.results, "read")
        if probe.direct_supported:
            for op in ("read", "write"):
                note(f"disk {op}: buffered")
                probe.measure(op, DiskSetting(best_read.setting.block_size, best_read.setting.queue_depth,
                                              best_read.setting.threads, direct=False))
        for op, warm in (("read", False), ("read", True), ("write", False)):
            note(f"disk {op}: mmap{' (warm page cache)' if warm else ''}")
            probe.measure_mmap(op, warm=warm)
        if dev.type == "cuda":
            from ._links import cuda_links

            note("cuda: host-device copies and their overlap with disk reads")
            settings = {"block_size": best_read.setting.block_size, "threads": best_read.setting.threads,
                        "queue_depth": best_read.setting.queue_depth}
            report.update(_cuda_report(cuda_links(dev, disk_file=probe.path, disk_bytes=probe.measure_bytes,
                                                  engine_settings=settings), dev))
        report["disk_direct_supported"] = bool(probe.direct_supported)
        report["disk_in_ram"] = ram_file_system(path)  # "tmpfs", "ramfs" or None
        report["disk_bytes_per_measurement"] = probe.measure_bytes
        report.update(disk_report(probe.results, choice, first, passes, cached))
        report["disk_mmap"] = {f"{k}_gbps": round(v, 4) for k, v in probe.mmap_results.items()}
    if validate:
        from ._validate import validate as run_validation

        report["validation"] = run_validation(path, report, validate, note)
    if fio:
        note("fio: the best settings again")
    report["fio"] = _fio_check(path, report) if fio else None
    if dev.type != "cuda":
        report.update({"h2d_pinned_gbps": None, "d2h_pinned_gbps": None, "h2d_pageable_gbps": None,
                       "d2h_pageable_gbps": None, "pcie": None, "disk_h2d_overlap": None,
                       "cuda_free_bytes": None})

    from ._links import adam_throughput, host_copy

    note("host memory copy")
    copy = host_copy(256 << 20 if mode == "quick" else 1 << 30)
    report["host_copy_gbps"] = copy.pop("host_copy_gbps")
    report["host_copy"] = copy
    note("CPU AdamW step")
    adam = adam_throughput(16 << 20 if mode == "quick" else 64 << 20)
    report["adam_params_per_s"] = adam.pop("adam_params_per_s")
    report["adam"] = adam
    report["elapsed_s"] = round(time.perf_counter() - started, 2)
    if cache:
        report["saved_as_cache"] = _cache(report, os.path.join(path, CACHE_NAME))
    return report


def _cache(report: dict[str, Any], target: str) -> bool:
    """Save ``report`` where io="auto" finds it, unless the profile cached there measured
    more bytes per measurement on this file system (a quick check at a small --size would
    replace it with settings it could not exercise: the in-flight bytes are capped by the
    file). Returns whether it was saved."""
    found = find_profile(os.path.dirname(target))
    if found is not None and found.path == target:
        before = found.report.get("disk_bytes_per_measurement") or 0
        if before > report["disk_bytes_per_measurement"]:
            log.warning("kept the cached profile %s, measured on %s per measurement (this run: %s); this run's "
                        "figures are in its report only. Remove that file, or run with a --size as large, to "
                        "replace it", target, format_size(before), format_size(report["disk_bytes_per_measurement"]))
            return False
    save_report(report, target)
    return True


def planned_steps(mode: str, cuda: bool, fio: bool, validate: bool = False) -> int:
    """How many progress notes :func:`run_profile` makes (for a progress bar's total)."""
    return (1 + 2 * len(sweep_grid(mode)) + 2 * 3 * (_RETRIES - 1) + 2 * _PASSES + 1 + 2 + 3 + int(cuda)
            + int(fio) + 2 + 3 * int(validate))


def save_report(report: dict[str, Any], target: str) -> None:
    """Write ``report`` as JSON, atomically (a reader never sees half a file)."""
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------------------------------
def _fio_check(path: str, report: dict[str, Any]) -> dict[str, Any] | None:
    from ._fio import fio_available, hugetlb_free_bytes, remove, run_fio

    if not fio_available():
        log.warning("--fio: fio is not installed (apt-get install fio); no fio column")
        return None
    filename = os.path.join(path, f".offload-profile-{os.getpid()}-fio.tmp")
    size = report["disk_bytes_per_measurement"]
    try:
        out: dict[str, Any] = {"size": size, "ioengine": "libaio", "direct": True}
        for op in ("read", "write"):  # read first: fio lays the file out, the write overwrites
            best = report[f"disk_best_{op}"]
            in_flight = best["block_size"] * best["queue_depth"]
            # fio's malloc buffers are 4 KiB pages; ours are huge pages: fio gets them too
            # where hugetlb pages are free (see _fio.py)
            kinds = ["malloc"] + (["shmhuge"] if hugetlb_free_bytes() >= in_flight else [])
            figures = {kind: run_fio(filename, size, op, best["block_size"], best["queue_depth"], iomem=kind)
                       for kind in kinds}
            kind = max(figures, key=figures.get)
            out[f"{op}_gbps"], out[f"{op}_iomem"] = figures[kind], kind
            out[f"{op}_share"] = best["gbps"] / figures[kind]  # the same setting on both sides
        return out
    finally:
        remove(filename)


def _host_facts() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "ram_total_bytes": vm.total, "ram_available_bytes": vm.available,
            "platform": platform.platform()}


def _sustained(probe: DiskProbe, setting: DiskSetting, first: DiskResult,
               note: Callable[[str], None]) -> tuple[list[DiskResult], list[DiskResult]]:
    """The figures the recommendation uses: with the engine's chosen setting, writes then
    reads of about ``_PASS_SECONDS`` of bytes each at the rate the sweep saw for that
    setting and direction (at most half the file: see DiskProbe), ``_PASSES`` times; then
    the cached best case, the same bytes read twice and written twice."""
    nbytes = {}
    for op in ("write", "read"):
        seen = [r.gbps for r in probe.results if r.op == op and r.setting == setting] or [first.gbps]
        nbytes[op] = probe.stretch(int(max(max(seen), 0.05) * 1e9 * _PASS_SECONDS))
    passes = []
    for i in range(_PASSES):
        for op in ("write", "read"):
            note(f"disk {op}: sustained pass {i + 1} of {_PASSES} ({format_size(nbytes[op])})")
            passes.append(probe.measure(op, setting, nbytes[op], record=False))
    note("disk: cached re-read and rewrite")
    cached = [probe.measure_cached(op, setting) for op in ("read", "write")]
    return passes, cached


def _cuda_report(links: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    free, total = torch.cuda.mem_get_info(dev)
    out = {k: links.get(k) for k in ("h2d_pinned_gbps", "d2h_pinned_gbps", "h2d_pageable_gbps",
                                     "d2h_pageable_gbps", "pcie", "disk_h2d_overlap")}
    out.update({"cuda_free_bytes": free, "cuda_total_bytes": total, "cuda_device_name": links["cuda_device"],
                "cuda_pinned_page_locked": links["pinned_is_page_locked"]})
    return out
