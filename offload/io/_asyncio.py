"""An asyncio face over the same engine: ``await aread(...)`` without blocking the loop.

The bytes move on the engine's worker threads exactly as for the blocking calls; the
coroutine only waits for the completion, so the hot path is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._engine import EngineFile, FileEngine
from ._handle import IOHandle

__all__ = ["wait_async", "aread", "awrite"]


async def wait_async(handle: IOHandle) -> int:
    """Await ``handle`` from a coroutine; returns the byte count or raises its error."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def _wake(_: IOHandle) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))

    handle.add_done_callback(_wake)
    await future
    return handle.wait(0)


async def aread(engine: FileEngine, file: EngineFile, offset: int, dest: Any,
                length: int | None = None, *, priority: int = 1) -> int:
    return await wait_async(engine.read(file, offset, dest, length, priority=priority))


async def awrite(engine: FileEngine, file: EngineFile, offset: int, src: Any,
                 length: int | None = None, *, priority: int = 1) -> int:
    return await wait_async(engine.write(file, offset, src, length, priority=priority))
