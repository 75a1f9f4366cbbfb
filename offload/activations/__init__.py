"""Activation offload (ZeRO-R): what a wrapped model's forward saves for backward, moved to
host memory or NVMe beyond a budget and read back ahead of backward.

``offloader_for(config)`` builds the ``ActivationOffloader`` that ``offload.wrap`` attaches
when ``OffloadConfig.activation_tier`` is set. Its store is a ``TensorStore`` of its own (the
same tiers and file engine as the parameters', with budgets of its own, so activations never
take room the parameters' prefetch counts on); its swap files live in
``nvme_path/activations``.
"""

from __future__ import annotations

import logging
import os

from .._resolve import choose_io_backend, resolve_engine
from ..accel import accelerator_for
from .._units import format_size
from ..config import OffloadConfig
from ..store import Tier, create_store
from ._offloader import CHUNK_BYTES, ActivationOffloader, figures, on_device
from ._reader import ActivationCounts, ActivationOffloadError
from ._saved import KeptTensor, ModifiedSavedTensorError, SavedHandle, SavedState, kept
from ._writer import COPY_BUFFERS, DeviceWriter

__all__ = ["offloader_for", "ActivationOffloader", "ActivationCounts", "ActivationOffloadError",
           "ModifiedSavedTensorError", "KeptTensor", "kept", "SavedHandle", "SavedState", "chunk_bytes",
           "NO_ACTIVATION_STATS",
           "DeviceWriter", "COPY_BUFFERS", "on_device", "host_pool_bytes"]

log = logging.getLogger("offload")

# what offload.stats reports for a model whose activations are not offloaded
NO_ACTIVATION_STATS = figures(ActivationCounts(), [])


def chunk_bytes(config: OffloadConfig) -> int:
    """The piece a saved tensor moves in: at most 16 MiB, a quarter of the host buffers (on an
    accelerator two of them are the writer's, two are writes in flight), the read-ahead
    window; a multiple of 4 KiB."""
    limit = min(CHUNK_BYTES, config.activation_host_bytes() // 4, config.activation_prefetch)
    return max(4096, limit // 4096 * 4096)


def host_pool_bytes(config: OffloadConfig, accelerated: bool) -> int:
    """The store's host pool: activation_host_budget, less the writer's pinned buffers on an
    accelerator (so that all of them stay within the budget)."""
    return config.activation_host_bytes() - (COPY_BUFFERS * chunk_bytes(config) if accelerated else 0)


def offloader_for(config: OffloadConfig) -> ActivationOffloader:
    """The offloader ``config.activation_tier`` asks for (its store created here)."""
    if config.activation_tier is None:
        raise ValueError("activation_tier is None: activations stay where autograd puts them")
    chunk = chunk_bytes(config)
    accelerator = accelerator_for(config.torch_device)
    nvme = None
    backend = "direct"
    if config.activation_tier == "nvme":
        nvme = os.path.join(config.nvme_path, "activations")
        os.makedirs(nvme, exist_ok=True)
        # activations are written once and read once: the page cache would only hold them twice
        backend = choose_io_backend(config.replace(nvme_path=nvme), 1 << 62).backend
    elif accelerator is None:
        log.warning("offload: activation_tier='host' on a CPU device copies saved activations from host "
                    "memory to host memory; use activation_tier='nvme' to take them out of RAM")
    engine = resolve_engine(config)
    store = create_store(device=config.device, device_budget=config.activation_prefetch + chunk,
                         host_budget=host_pool_bytes(config, accelerator is not None), nvme_path=nvme,
                         file_size=config.file_size,
                         block_size=min(engine.block_size, chunk), threads=engine.threads,
                         queue_depth=engine.queue_depth, io_backend=backend)
    home = Tier.NVME if nvme is not None else Tier.HOST
    store.budget_names.update({Tier.HOST: "activation_host_budget (OffloadConfig)",
                               Tier.DEVICE: "activation_prefetch (OffloadConfig; the read-ahead window and a piece)"})
    try:
        writer = None if accelerator is None else DeviceWriter(accelerator, store, home, chunk)
    except BaseException:
        store.close()
        raise
    log.info("offload: saved activations (%s and larger) beyond the newest %s rest on %s; %s read ahead of "
             "backward", format_size(config.activation_min_bytes), format_size(config.activation_budget), home.value,
             format_size(config.activation_prefetch))
    return ActivationOffloader(store, home, device=config.torch_device, budget=config.activation_budget,
                               prefetch=config.activation_prefetch, min_bytes=config.activation_min_bytes,
                               chunk=chunk, writer=writer)
