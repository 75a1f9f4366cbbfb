"""Bytes between host memory and files: aligned buffers and an async file engine.

Knows nothing of torch modules or tiers. See ``FileEngine`` for the request model.
"""

from ._asyncio import aread, awrite, wait_async
from ._backend import FileBackend, logical_block_size
from ._buffers import BufferPool
from ._hostbuffer import PAGE_SIZE, HostBuffer, round_up
from ._registry import pool_bytes
from ._engine import EngineFile, EngineStats, FileEngine
from ._handle import IOHandle
from ._errors import BudgetError, DiskFullError, EngineClosedError, OffloadIOError

__all__ = [
    "FileEngine", "EngineFile", "EngineStats", "IOHandle", "FileBackend", "logical_block_size",
    "HostBuffer", "BufferPool", "pool_bytes", "round_up", "PAGE_SIZE",
    "OffloadIOError", "DiskFullError", "EngineClosedError", "BudgetError",
    "wait_async", "aread", "awrite",
]
