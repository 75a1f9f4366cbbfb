"""The process's memory as the kernel counts it: the resident set (RSS), its high-water
mark, and what it is made of.

The OOM killer reads RSS, not the runtime's accounting, so ``offload.stats``, the step log
and the trace break RSS down into: the interpreter and libraries (``baseline``, RSS when
``offload`` was imported), the runtime's buffer pools (``offload.io.pool_bytes``), the C
heap that torch's CPU tensors come from (activations, autograd's gradients, temporaries),
the freed bytes malloc keeps in its heaps, file pages mapped into the process (the mmap
backend's swap files, safetensors being read) and the rest, ``untracked``.

Note: the allocator. glibc's malloc serves a request above its mmap threshold with a
mapping of its own, returned to the kernel on free, and smaller ones from heaps it keeps.
The threshold starts at 128 KiB and rises to the size of each mapped block freed (up to
32 MiB), so after one step every tensor below 32 MiB comes from the heaps, and the tensors
freed each step leave holes that malloc keeps: the heap grows to about twice the tensors
alive at once. ``host_allocator="lean"`` fixes the threshold (``mallopt``) so that tensors
above it get mappings of their own and RSS follows what is alive; each such tensor is then
faulted in anew, which costs step time where tensors churn in host memory (a CPU device).
docs/memory.md has the measurements behind ``"auto"``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

import psutil

from .io import pool_bytes

__all__ = ["MMAP_THRESHOLD", "CUDA_KERNEL_HOST_BYTES", "HeapUse", "MemoryBreakdown", "HeapPeak", "HEAP_PEAK",
           "mark_baseline", "baseline_rss_bytes", "rss_bytes", "peak_rss_bytes", "heap_use", "allocator",
           "resolve_allocator", "tune_allocator", "heap_overhead_factor", "breakdown"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 10  # bytes: with host_allocator="lean", requests above it get mappings of their own
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# freed bytes glibc keeps beyond the tensors alive at once, as a share of them (GPT-2 124M to
# 774M on a CPU device: 0.5 to 0.9; docs/memory.md)
_GLIBC_HEAP_OVERHEAD = 1.0
# host memory the CUDA driver takes as torch loads its kernels at first use (lazy module
# loading: each dtype's matrix products, each elementwise and attention kernel), after
# torch.cuda.init(); an allowance from the GPT-2 training steps measured in docs/memory.md
CUDA_KERNEL_HOST_BYTES = 1280 << 20  # 1.25 GiB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def _malloc_name() -> str:
    """Which malloc this process calls: the library the dynamic linker resolved ``malloc``
    to (``dladdr``), so a jemalloc, tcmalloc or mimalloc preloaded in glibc's place is
    seen, and one that a library merely links is not."""
    try:
        proc = ctypes.CDLL(None)
        info = _DlInfo()
        if proc.dladdr(ctypes.cast(proc.malloc, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
            library = os.path.basename(os.fsdecode(info.dli_fname))
            for name in ("jemalloc", "tcmalloc", "mimalloc"):
                if name in library:
                    return name
        if hasattr(proc, "gnu_get_libc_version"):
            return "glibc"
    except (OSError, AttributeError):  # no dynamic linker to ask (not Linux)
        pass
    return "unknown"


def _glibc() -> ctypes.CDLL | None:
    """glibc, where it is the malloc in use (mallopt: every version; mallinfo2: 2.33+)."""
    if _MALLOC != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _Mallinfo2
    return libc


_MALLOC = _malloc_name()
_libc = _glibc()
_COUNTS = _libc is not None and hasattr(_libc, "mallinfo2")  # heap counts (another malloc: of nothing)
_RSS_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _status(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status, in bytes (None where there is none)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _raw_heap() -> tuple[int, int]:
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd, m.fordblks


@dataclass
class _Baseline:
    rss: int = 0
    file: int = 0  # file pages mapped then (libraries)
    heap: int = 0
    free: int = 0


_BASE = _Baseline()


def mark_baseline() -> None:
    """Take the baseline now (``offload/__init__`` calls this once its imports are done)."""
    _BASE.rss = rss_bytes()
    _BASE.file = _status("RssFile") or 0
    if _COUNTS:
        _BASE.heap, _BASE.free = _raw_heap()


def baseline_rss_bytes() -> int:
    """The process's RSS when offload was imported (the interpreter, torch and the
    libraries imported before it), less the freed bytes malloc kept then (counted with
    malloc's kept memory, ``HeapUse.kept_free``)."""
    return max(0, _BASE.rss - _BASE.free)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _RSS_PAGE
    except OSError:
        return psutil.Process(os.getpid()).memory_info().rss


def peak_rss_bytes() -> int:
    """The process's high-water mark of RSS (``VmHWM``): what an OOM kill would have seen."""
    peak = _status("VmHWM")
    if peak is not None:
        return peak
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (bytes on macOS, KiB elsewhere)


@dataclass(frozen=True)
class HeapUse:
    """glibc's heaps now, counted from the baseline."""

    in_use: int  # bytes handed out and not freed since the baseline: torch's CPU tensors, other C allocations
    kept_free: int  # freed bytes malloc keeps in its heaps now (resident where they were touched)


def heap_use() -> HeapUse | None:
    """malloc's counts (glibc 2.33+), or None where they are not available (another
    malloc, another C library, an older glibc)."""
    if not _COUNTS:
        return None
    in_use, free = _raw_heap()
    return HeapUse(in_use=max(0, in_use - _BASE.heap), kept_free=free)


def allocator() -> str:
    """Which malloc serves torch's CPU tensors: "glibc", a preloaded "jemalloc",
    "tcmalloc" or "mimalloc", or "unknown"."""
    return _MALLOC


def resolve_allocator(setting: str, device_type: str) -> str:
    """``OffloadConfig.host_allocator`` as it applies here: "auto" is "lean" where the
    compute device is not the CPU (torch's tensors live on the device and the optimizer
    works in the pools, so little host memory churns and returning it should cost little;
    not measured on a GPU yet) and "system" on a CPU device (where activations and
    gradients churn through host memory each step and the lean setting costs step time:
    docs/memory.md)."""
    if setting != "auto":
        return setting
    return "system" if device_type == "cpu" else "lean"


_tuned: str | None = None  # what tune_allocator did, once "lean" was asked for
_lean = False  # whether the threshold is fixed
_tune_lock = threading.Lock()


def tune_allocator(mode: str) -> str:
    """Apply ``mode`` ("lean" or "system", resolved) to this process's malloc; returns what
    was done, for the log. "lean" is applied once and stays for the process (glibc cannot
    go back to its sliding threshold)."""
    global _tuned, _lean
    with _tune_lock:
        if mode != "lean":
            if _lean:
                log.warning("offload: host_allocator='%s' asked for, but this process applied 'lean' already "
                            "(a model wrapped earlier): glibc cannot go back, so it stays lean", mode)
            return _tuned or f"malloc left as it is ({allocator()}, host_allocator='{mode}')"
        if _tuned is None:
            if _libc is None:
                _tuned = f"malloc left as it is ({allocator()}: host_allocator='lean' applies to glibc only)"
            elif _libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
                _lean = True
                _tuned = (f"glibc's mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB (host_allocator='lean': "
                          "freed tensors go back to the kernel)")
            else:
                _tuned = "malloc left as it is (mallopt refused the mmap threshold)"
            log.info("offload: %s", _tuned)
        return _tuned


def heap_overhead_factor(mode: str) -> float:
    """Freed bytes the allocator is expected to keep, as a share of the tensors alive at
    once (what ``offload.plan`` adds for them): glibc's heaps with ``mode`` "system", none
    with "lean" or another malloc (which return freed memory themselves)."""
    if mode == "lean" or _lean or _libc is None:
        return 0.0
    return _GLIBC_HEAP_OVERHEAD


class HeapPeak:
    """The largest C heap in use seen since the last :meth:`take`, sampled where the
    runtime passes: each parameter group's use in forward and backward, each gradient as
    autograd hands it over, each optimizer shard."""

    def __init__(self) -> None:
        self._peak = 0
        self._lock = threading.Lock()  # (sampled from autograd's device threads and the drain thread too)

    def sample(self) -> None:
        if not _COUNTS:
            return
        in_use = _raw_heap()[0] - _BASE.heap
        with self._lock:
            self._peak = max(self._peak, in_use)

    def peek(self) -> int:
        """The peak since the previous :meth:`take`, without starting anew."""
        self.sample()
        return max(0, self._peak)

    def take(self) -> int:
        """The peak since the previous call (at least the heap in use now); starts anew."""
        self.sample()
        with self._lock:
            peak, self._peak = self._peak, 0
        return max(0, peak)


# One process, one heap: every wrapped model and optimizer samples it, and each step record
# takes it (two models logging steps in one process each see the peak since the other's record).
HEAP_PEAK = HeapPeak()


@dataclass(frozen=True)
class MemoryBreakdown:
    """What the process's RSS is made of, now (and the heap's peak since the last record)."""

    rss: int
    rss_peak: int  # VmHWM: the most ever resident
    baseline: int
    pools: dict[str, int] = field(default_factory=dict)  # offload's buffer pools by name
    heap: int = 0  # C heap in use now (torch's CPU tensors, ...); 0 where unknown
    heap_peak: int = 0  # its most since the previous record
    heap_free: int = 0  # freed bytes malloc keeps
    mapped_files: int = 0  # file pages mapped since the baseline (mmap backend, checkpoints read)
    allocator: str = "unknown"

    @property
    def untracked(self) -> int:
        """RSS that none of the parts above accounts for (Python objects, thread stacks,
        caches of other libraries; torch's tensors too where the heap cannot be read)."""
        return self.rss - self.baseline - sum(self.pools.values()) - self.heap - self.heap_free - self.mapped_files

    def record(self) -> dict[str, int | str]:
        """The flat ``mem_*`` / ``rss_*`` fields of a step record."""
        return {"rss_bytes": self.rss, "rss_peak_bytes": self.rss_peak, "mem_baseline_bytes": self.baseline,
                "mem_host_pool_bytes": self.pools.get("host", 0), "mem_device_pool_bytes": self.pools.get("device", 0),
                "mem_other_pools_bytes": sum(v for k, v in self.pools.items() if k not in ("host", "device")),
                "mem_heap_bytes": self.heap, "mem_heap_peak_bytes": self.heap_peak,
                "mem_heap_free_bytes": self.heap_free, "mem_mapped_files_bytes": self.mapped_files,
                "mem_untracked_bytes": self.untracked, "allocator": self.allocator}


def breakdown(heap_peak: int | None = None) -> MemoryBreakdown:
    """RSS now and its parts. ``heap_peak``: the heap's peak to report (default: the heap
    in use now)."""
    rss = rss_bytes()
    heap = heap_use()
    mapped = max(0, (_status("RssFile") or 0) - _BASE.file)
    in_use = heap.in_use if heap is not None else 0
    return MemoryBreakdown(rss=rss, rss_peak=max(rss, peak_rss_bytes()), baseline=baseline_rss_bytes(),
                           pools=pool_bytes(),
                           heap=in_use, heap_peak=max(in_use, heap_peak or 0),
                           heap_free=heap.kept_free if heap is not None else 0, mapped_files=mapped,
                           allocator=allocator())
