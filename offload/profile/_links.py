"""Host memory, the CPU optimizer, and (on CUDA) the host-device link.

Each function returns a plain dict of figures; none keeps memory after it returns.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

import torch

from ..accel import accelerator_for
from ..io import FileEngine, HostBuffer

__all__ = ["host_copy", "adam_throughput", "cuda_links", "pcie_theoretical_gbps"]

log = logging.getLogger(__name__)
_MiB = 1 << 20


def host_copy(nbytes: int = 256 * _MiB, repeats: int = 5) -> dict[str, Any]:
    """Host-to-host copy bandwidth (bytes copied per second; each byte is read once and
    written once) between two page-aligned buffers, with torch's copy on all its threads."""
    src, dst = HostBuffer(nbytes), HostBuffer(nbytes)
    try:
        a, b = src.bytes, dst.bytes
        a.fill_(1)
        b.copy_(a)  # warm: both sides faulted in and in the TLB
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - started)
        best = min(times)
        return {"host_copy_gbps": nbytes / best / 1e9, "bytes": nbytes, "threads": torch.get_num_threads(),
                "seconds": [round(t, 6) for t in times]}
    finally:
        src.close()
        dst.close()


def adam_throughput(params: int = 16 << 20, steps: int = 5) -> dict[str, Any]:
    """Parameters per second of :class:`offload.AdamW` stepping ``params`` fp32 parameters
    whose states rest in host memory: the fused torch kernel the runtime calls, through the
    same shard loop, without I/O."""
    from ..optim import AdamW

    weight = torch.nn.Parameter(torch.randn(params) * 0.02)
    weight.grad = torch.randn(params) * 1e-3
    opt = AdamW([weight], lr=1e-4, weight_decay=0.01)
    try:
        opt.step()  # first step allocates the states
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
        median = statistics.median(times)
        return {"adam_params_per_s": params / median, "params": params, "threads": torch.get_num_threads(),
                "kernel": "torch fused AdamW (CPU)", "seconds": [round(t, 6) for t in times]}
    finally:
        opt.close()


def pcie_theoretical_gbps(device: torch.device) -> dict[str, Any] | None:
    """The negotiated PCIe link of ``device`` from sysfs: generation speed x lanes, less the
    line encoding, in GB/s per direction. ``None`` where sysfs does not say (SXM boards
    behind a switch report the switch's link, which is what host copies cross anyway)."""
    try:
        props = torch.cuda.get_device_properties(device)
        bus_id = "%04x:%02x:%02x.0" % (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except (AttributeError, RuntimeError):
        return None
    base = f"/sys/bus/pci/devices/{bus_id}"
    try:
        with open(f"{base}/current_link_speed") as fh:
            speed = fh.read().split()[0]  # "16.0 GT/s PCIe" or "16 GT/s"
        with open(f"{base}/current_link_width") as fh:
            width = int(fh.read().strip())
        gts = float(speed)
    except (OSError, ValueError, IndexError):
        return None
    encoding = 8 / 10 if gts <= 5.0 else 128 / 130  # gen 1-2: 8b/10b; gen 3 and later: 128b/130b
    return {"bus_id": bus_id, "gt_per_s": gts, "lanes": width, "gbps": gts * width * encoding / 8}


def cuda_links(device: torch.device, nbytes: int = 256 * _MiB, repeats: int = 5,
               disk_file: str | None = None, disk_bytes: int = 0, engine_settings: dict | None = None,
               ) -> dict[str, Any]:
    """Host-to-device and device-to-host bandwidth, pinned and pageable, each the best of
    ``repeats`` copies of ``nbytes`` timed with CUDA events; and, when ``disk_file`` is given,
    whether an O_DIRECT read of it and pinned H2D copies overlap (each measured alone, then
    both at once)."""
    torch.cuda.set_device(device)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = HostBuffer(nbytes, pin=accelerator_for(device))
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(3)
    out: dict[str, Any] = {"cuda_device": torch.cuda.get_device_name(device), "bytes": nbytes,
                           "pinned_is_page_locked": pinned.pinned}
    try:
        host_pinned = pinned.bytes
        for name, dst, src in (("h2d_pinned", gpu, host_pinned), ("h2d_pageable", gpu, pageable),
                               ("d2h_pinned", host_pinned, gpu), ("d2h_pageable", pageable, gpu)):
            out[f"{name}_gbps"] = nbytes / _best_copy_seconds(dst, src, repeats) / 1e9
        pcie = pcie_theoretical_gbps(device)
        out["pcie"] = pcie
        if disk_file is not None and disk_bytes > 0:
            out["disk_h2d_overlap"] = _overlap(device, gpu, host_pinned, disk_file, disk_bytes,
                                               engine_settings or {})
        return out
    finally:
        del gpu
        pinned.close()
        torch.cuda.empty_cache()


def _best_copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    stream = torch.cuda.Stream()
    dst.copy_(src, non_blocking=True)  # warm-up (driver staging buffers, first-touch)
    torch.cuda.synchronize()
    best = float("inf")
    with torch.cuda.stream(stream):
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _overlap(device: torch.device, gpu: torch.Tensor, host: torch.Tensor, disk_file: str,
             disk_bytes: int, settings: dict) -> dict[str, Any]:
    """Disk read alone, H2D alone, then both at once for the length of the disk read."""
    read_buf = HostBuffer(min(disk_bytes, 256 * _MiB), pin=accelerator_for(device))
    try:
        def disk_read() -> float:
            with FileEngine(name="offload-profile", **settings) as engine:
                file = engine.open(disk_file)
                started = time.perf_counter()
                handles = [engine.read(file, off, read_buf, min(read_buf.nbytes, disk_bytes - off))
                           for off in range(0, disk_bytes, read_buf.nbytes)]
                for h in handles:
                    h.wait()
                seconds = time.perf_counter() - started
                engine.close_file(file)
            return disk_bytes / seconds / 1e9

        stream = torch.cuda.Stream()

        def h2d_until(stop: threading.Event, moved: list[int], seconds: list[float]) -> None:
            torch.cuda.set_device(device)
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    gpu.copy_(host, non_blocking=True)
                    stream.synchronize()
                    moved[0] += host.numel()
            seconds[0] = time.perf_counter() - started

        disk_alone = disk_read()
        h2d_alone = gpu.numel() / _best_copy_seconds(gpu, host, 3) / 1e9
        stop, moved, seconds = threading.Event(), [0], [0.0]
        copier = threading.Thread(target=h2d_until, args=(stop, moved, seconds), daemon=True)
        copier.start()
        try:
            disk_both = disk_read()
        finally:
            stop.set()
            copier.join()
        h2d_both = moved[0] / seconds[0] / 1e9 if seconds[0] else 0.0
        efficiency = (disk_both / disk_alone + h2d_both / h2d_alone) / 2
        return {"disk_read_alone_gbps": disk_alone, "h2d_alone_gbps": h2d_alone,
                "disk_read_with_h2d_gbps": disk_both, "h2d_with_disk_gbps": h2d_both,
                "overlap_efficiency": efficiency, "overlaps": efficiency >= 0.9}
    finally:
        read_buf.close()
