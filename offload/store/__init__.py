"""The tiered tensor store: a handle per stored tensor, tiers behind one small interface.

``create_store`` wires the usual tiers (compute device, host, NVMe files) from budgets;
``TensorStore`` takes any mapping of tiers: a tier implements ``TierBackend`` and returns a
``Done`` or a ``Pending`` completion from its transfers (the schedule tests' in-memory
``FakeTier``, tests/store/conftest.py, is one).
"""

from __future__ import annotations

import torch

from .._units import parse_size
from ..accel import accelerator_for, host_compute
from ..io import BudgetError, BufferPool, FileBackend, FileEngine
from ._inplace import CheckpointChangedError, CheckpointRange
from ._mmap import MmapTier
from ._nvme import DirectoryLockedError, Extent, SwapFiles
from ._state import Residency, StoreError, Tier, TransferInterrupted
from ._store import StoredTensor, TensorStore
from ._tiers import Completion, DeviceTier, Done, HostMemoryTier, NvmeTier, Pending, TierBackend

__all__ = [
    "create_store", "TensorStore", "StoredTensor", "Tier", "Residency", "StoreError", "TransferInterrupted",
    "BudgetError", "TierBackend", "HostMemoryTier", "DeviceTier", "NvmeTier", "Completion", "Done", "Pending",
    "SwapFiles", "Extent", "DirectoryLockedError", "MmapTier", "device_slot_size", "host_slot_size",
    "CheckpointRange", "CheckpointChangedError",
]


def device_slot_size(device: str | torch.device, nbytes: int) -> int:
    """Bytes of device budget a tensor of ``nbytes`` takes on ``device``'s DEVICE tier (its
    slots are rounded), for sizing before a store exists."""
    align = HostMemoryTier.SLOT_ALIGN if host_compute(device) else DeviceTier.SLOT_ALIGN
    return -(-max(nbytes, 1) // align) * align


def host_slot_size(nbytes: int) -> int:
    """Bytes of host budget a tensor of ``nbytes`` takes in the HOST tier (whole pages)."""
    return -(-max(nbytes, 1) // HostMemoryTier.SLOT_ALIGN) * HostMemoryTier.SLOT_ALIGN


def create_store(*, device: str | torch.device = "cpu", device_budget: int | str = "4GiB",
                 host_budget: int | str = "8GiB", nvme_path: str | None = None,
                 nvme_budget: int | str | None = None, file_size: int | str = "1GiB",
                 block_size: int | str = "8MiB", threads: int = 32, queue_depth: int = 32,
                 direct: bool = True, file_backend: FileBackend | None = None,
                 io_backend: str = "direct") -> TensorStore:
    """A store with a DEVICE tier, a HOST tier and, when ``nvme_path`` is given, an NVME tier.

    ``device`` is the compute device ("cpu", "cuda", "cuda:N"). On a CPU device the DEVICE
    tier is page-aligned host memory, so NVMe reads land directly in the buffers compute
    uses. With an accelerator (``offload.accel``: CUDA) the DEVICE tier is its memory and
    host buffers are pinned for it. The I/O settings (``block_size``,
    ``threads``, ``queue_depth``, ``direct``) configure the file engine of the NVME tier;
    ``file_backend`` replaces its system calls (fault-injection tests pass a faulty one).
    ``io_backend``: ``"direct"`` moves NVMe bytes with the file engine (O_DIRECT where the
    file system allows); ``"mmap"`` through shared mappings of the same files
    (``MmapTier``: the page cache serves repeated reads; pages held on purpose stay within
    the host budget).
    The defaults keep 256 MiB in the kernel at once (8 MiB x 32), as fio's best
    configuration on the reference disk does (docs/benchmarks.md); workers blocked in
    system calls cost no CPU.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available: use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    device_bytes = parse_size(device_budget, name="device_budget")
    accelerator = accelerator_for(device)
    host_pool = BufferPool(parse_size(host_budget, name="host_budget"), pin=accelerator, name="host")
    tiers: dict[Tier, TierBackend] = {Tier.HOST: HostMemoryTier(Tier.HOST, host_pool)}
    if accelerator is not None:
        tiers[Tier.DEVICE] = DeviceTier(accelerator, device_bytes)
    else:
        # (groups, and the activations' copies, are written into these before anything reads
        # them: their writer faults the pages in; BufferPool's fault_in)
        tiers[Tier.DEVICE] = HostMemoryTier(Tier.DEVICE, BufferPool(device_bytes, name="device", fault_in=False))
    if io_backend not in ("direct", "mmap"):
        raise ValueError(f"io_backend={io_backend!r}: use 'direct' or 'mmap'")
    if nvme_path is not None:
        mapped = io_backend == "mmap"
        engine = FileEngine(block_size=parse_size(block_size, name="block_size"), threads=1 if mapped else threads,
                            queue_depth=1 if mapped else queue_depth, direct=direct and not mapped,
                            backend=file_backend)
        try:
            files = SwapFiles(nvme_path, engine, file_size=parse_size(file_size, name="file_size"))
        except BaseException:
            engine.close()
            raise
        budget = parse_size(nvme_budget, name="nvme_budget") if nvme_budget is not None else None
        if mapped:
            tiers[Tier.NVME] = MmapTier(files, engine, threads=min(threads, 4), budget=budget,
                                        cache_limit=host_pool.budget)
        else:
            tiers[Tier.NVME] = NvmeTier(files, engine, budget)
    return TensorStore(tiers, staging=host_pool, device=device)
