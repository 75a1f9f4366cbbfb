"""The CUDA accelerator: torch's streams, events and caching allocator, and the CUDA
runtime's host registration. Kept thin: everything that decides lives above the seam."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import torch

from ._api import Accelerator, Event, Stream

__all__ = ["CudaAccelerator"]

log = logging.getLogger(__name__)


class CudaAccelerator(Accelerator):
    def __init__(self, device: torch.device):
        self.device = device

    def stream(self) -> Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def using(self, stream: Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Event:
        return torch.cuda.Event()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self, tensor: torch.Tensor) -> None:
        pass  # the caching allocator frees the block with its last reference, after the recorded streams

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def pin(self, address: int, nbytes: int) -> bool:
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of %d bytes failed (error %s); using pageable memory", nbytes, err)
            return False
        return True

    def unpin(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)
