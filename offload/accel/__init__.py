"""The one seam for what is device-specific: streams, events, asynchronous copies between
host and device memory, host-memory registration, device memory accounting.

``accelerator_for(device)`` answers the accelerator that computes on ``device``, or None
where compute runs in host memory (the CPU). Code that differs for a device with memory of
its own asks this, never ``device.type``; so a test can run every such path on the CPU by
putting a simulated accelerator in place with ``simulate`` (tests/simdevice; never for
users: it changes what ``"cpu"`` means for the whole process).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from ._api import Accelerator, Event, Stream
from ._cuda import CudaAccelerator

__all__ = ["Accelerator", "Stream", "Event", "CudaAccelerator", "accelerator_for", "host_compute", "simulate"]

_lock = threading.Lock()
_cuda: dict[int | None, CudaAccelerator] = {}  # by index (None: the current device)
_simulated: Accelerator | None = None


def accelerator_for(device: str | torch.device) -> Accelerator | None:
    """The accelerator of ``device``; None for the CPU (unless a simulation is in place)."""
    device = torch.device(device)
    if device.type == "cpu":
        return _simulated
    if device.type != "cuda":
        return None
    with _lock:  # (made without touching CUDA: a plan for a GPU machine may be made on a CPU one)
        acc = _cuda.get(device.index)
        if acc is None:
            acc = _cuda[device.index] = CudaAccelerator(device)
        return acc


def host_compute(device: str | torch.device) -> bool:
    """Whether compute on ``device`` reads host memory directly (no device memory between)."""
    return torch.device(device).type == "cpu" and _simulated is None


@contextmanager
def simulate(accelerator: Accelerator) -> Iterator[Accelerator]:
    """Inside the block, the CPU device behaves as ``accelerator`` (whose tensors are CPU
    tensors): stores, the gradient drain and pinning take their device paths. Tests only."""
    global _simulated
    with _lock:
        if _simulated is not None:
            raise RuntimeError("a simulated accelerator is already in place")
        _simulated = accelerator
    try:
        yield accelerator
    finally:
        with _lock:
            _simulated = None
