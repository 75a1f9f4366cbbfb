"""What an asynchronous compute device must offer the runtime: the seam's interface.

Note: the shapes follow CUDA's, since CUDA is the device this exists for: streams run
their work in order and later than it was issued; an event completes when its stream
reaches it; a stream can wait for an event without blocking the host. Device memory is
allocated in the order of the stream current at the time, and ``record_stream`` tells the
allocator which other streams still use a block when it is released.
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from typing import Protocol

import torch

__all__ = ["Accelerator", "Stream", "Event"]


class Event(Protocol):
    def record(self, stream: "Stream") -> None:
        """Complete once ``stream`` has run everything queued on it so far."""

    def synchronize(self) -> None:
        """Block the calling thread until the event completes (at once if never recorded)."""

    def query(self) -> bool:
        """Whether the event has completed."""


class Stream(Protocol):
    def wait_event(self, event: Event) -> None:
        """Work queued on this stream from now on starts after ``event`` completes."""

    def wait_stream(self, stream: "Stream") -> None:
        """Work queued on this stream from now on starts after what ``stream`` has queued."""


class Accelerator(abc.ABC):
    """A compute device with memory of its own and asynchronous copies to and from host
    memory (``CudaAccelerator``; tests also run a simulated one)."""

    device: torch.device  # torch's device of the tensors it allocates and computes on

    # -- streams and events ----------------------------------------------------------------
    @abc.abstractmethod
    def stream(self) -> Stream:
        """A new side stream."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The calling thread's current stream (compute runs on it)."""

    @abc.abstractmethod
    def using(self, stream: Stream) -> AbstractContextManager:
        """Make ``stream`` the calling thread's current stream inside the block."""

    @abc.abstractmethod
    def event(self) -> Event:
        """A new event, not yet recorded."""

    # -- memory ------------------------------------------------------------------------------
    @abc.abstractmethod
    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uninitialised device memory (uint8), in the current stream's order."""

    @abc.abstractmethod
    def release(self, tensor: torch.Tensor) -> None:
        """Its owner is done with ``tensor`` from ``empty``: its memory may be reused once
        every stream recorded on it (``record_stream``) has passed the work queued now."""

    @abc.abstractmethod
    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``stream`` uses ``tensor``: do not reuse its memory before that work is done."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (one in host memory, one on the device) asynchronously,
        on the current stream. The host side must stay untouched until the copy completes."""

    @abc.abstractmethod
    def pin(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory for asynchronous copies; False (and a warning) where the
        device refuses: the memory stays pageable and copies from it are synchronous."""

    @abc.abstractmethod
    def unpin(self, address: int) -> None:
        """Undo ``pin`` of the memory at ``address``."""

    @abc.abstractmethod
    def allocated_bytes(self) -> int:
        """Device memory held by live tensors now."""
