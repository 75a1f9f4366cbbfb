"""A simulated asynchronous device on the CPU, for tests only (``offload.accel.simulate``).

Each side stream is a worker thread that runs its queued work in order, each item after a
seeded random delay, so copies land later than they were issued. Events complete when
their stream reaches them, and waiting on one really blocks. Compute runs on the calling
thread: the current stream of a thread that has not chosen a side stream is synchronous,
like a kernel that has finished by the time the next host line runs.

"Device" tensors are separate CPU tensors under their own byte capacity. They start filled
with 0xFF bytes (NaN in fp32, fp16 and bf16) and are filled so again when released, in the
order of the stream that allocated them and after the streams recorded on them, as the
next user of the memory would overwrite it; then the memory is handed out again to the next
allocation of its size on that stream (CUDA's caching allocator reuses it the same way). A read before a copy lands, or after the slot
was given back, so shows as a wrong value instead of passing by luck.

A copy between device memory and unpinned host memory runs synchronously (CUDA's own
rule for pageable memory); ``pageable_copies`` counts them.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from offload.accel import Accelerator

from .races import HOST, Clocks, ComputeAccesses, RaceError, storage_ptr

POISON = 0xFF


class SimEvent:
    def __init__(self, clocks: Clocks) -> None:
        self.clocks = clocks
        self.vc: dict[int, int] | None = None  # what it stands for (races.Clocks)
        self._done = threading.Event()
        self._done.set()  # never recorded: complete, as CUDA's

    def record(self, stream: "SimStream") -> None:
        with stream.order:  # (the count and the queue agree: another thread may queue on it too)
            self.clocks.tick(stream.sid)
            self.vc = self.clocks.snapshot(stream.sid)
            self._done.clear()
            stream.submit(self._done.set)

    def synchronize(self) -> None:
        self._done.wait()
        if self.vc is not None:
            self.clocks.observe(self.vc)

    def query(self) -> bool:
        return self._done.is_set()


class SimStream:
    """``synchronous``: the compute stream (its work runs on the calling thread at once)."""

    def __init__(self, sim: "SimAccelerator", name: str, *, synchronous: bool = False):
        self.sim, self.name, self.synchronous = sim, name, synchronous
        self.sid = id(self)
        self.order = threading.RLock()  # held while an access is counted and its work queued
        sim.clocks.add_stream(self.sid, name)
        if not synchronous:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._rng = random.Random(sim.next_seed())
            self._thread = threading.Thread(target=self._run, name=f"simdevice-{name}", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        if self.synchronous:
            fn()
        else:
            self._queue.put(fn)

    def wait_event(self, event: SimEvent) -> None:
        with self.order:
            if event.vc is not None:
                self.sim.clocks.merge(self.sid, event.vc)
            self.submit(event._done.wait)

    def wait_stream(self, stream: "SimStream") -> None:
        event = SimEvent(self.sim.clocks)
        event.record(stream)
        self.wait_event(event)

    def close(self) -> None:
        if not self.synchronous:
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (fn := self._queue.get()) is not None:
            delay = self._rng.uniform(0, self.sim.max_delay)
            if delay:
                time.sleep(delay)
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - kept for the test to raise
                self.sim.errors.append(err)


@dataclass(eq=False)
class _Block:
    tensor: torch.Tensor
    stream: SimStream  # the one it was allocated on
    recorded: set = field(default_factory=set)


class SimAccelerator(Accelerator):
    """``capacity``: device bytes (allocating beyond raises, like a device out of memory);
    ``max_delay``: seconds, the most a stream holds each queued item back."""

    def __init__(self, *, seed: int = 0, max_delay: float = 0.002, capacity: int = 1 << 34):
        self.device = torch.device("cpu")
        self.max_delay, self.capacity = max_delay, capacity
        self.clocks = Clocks()
        self._seeds = random.Random(seed)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.compute = SimStream(self, "compute", synchronous=True)
        self.streams: list[SimStream] = []
        self._blocks: dict[int, _Block] = {}
        self._cache: dict[tuple[int, int], list[torch.Tensor]] = {}  # freed blocks by (size, stream)
        self._pinned: dict[int, int] = {}
        self._unrecorded: dict[tuple[int, int], str] = {}  # (memory, stream): read there, not recorded
        self._made_on: dict[int, int] = {}  # memory -> the stream whose kernel made it (last)
        self.allocated = self.peak = 0
        self.pageable_copies = 0
        self.errors: list[BaseException] = []
        self.accesses = ComputeAccesses(self._operator)

    def next_seed(self) -> int:
        return self._seeds.randrange(1 << 30)

    # -- streams and events -----------------------------------------------------------------
    def stream(self) -> SimStream:
        with self._lock:
            s = SimStream(self, f"side{len(self.streams)}")
            self.streams.append(s)
        return s

    def current_stream(self) -> SimStream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def using(self, stream: SimStream) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def event(self) -> SimEvent:
        return SimEvent(self.clocks)

    # -- memory -------------------------------------------------------------------------------
    def empty(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self.allocated + nbytes > self.capacity:
                raise torch.OutOfMemoryError(f"simulated device: {nbytes} bytes more than the "
                                             f"{self.capacity} capacity ({self.allocated} in use)")
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
        stream = self.current_stream()
        with self._lock:  # a block freed on this stream is handed out again, as CUDA's allocator does
            cached = self._cache.get((nbytes, stream.sid))
            t = cached.pop() if cached else None
        if t is None:
            with self._quiet():
                t = torch.full((nbytes,), POISON, dtype=torch.uint8)
            self.clocks.forget(t.data_ptr())
            self.clocks.allocated(t.data_ptr(), stream.sid)
        with self._lock:
            self._blocks[t.data_ptr()] = _Block(t, stream)
        return t

    def release(self, tensor: torch.Tensor) -> None:
        with self._lock:
            block = self._blocks.pop(tensor.data_ptr())
            self.allocated -= tensor.numel()
        stream = block.stream
        with self._lock:
            recorded = set(block.recorded) - {stream}
        for other in recorded:
            stream.wait_stream(other)
        with stream.order:
            self.clocks.access(stream.sid, tensor.data_ptr(), write=True, what="the next use of freed memory")
            stream.submit(self._quietly(lambda t=block.tensor: t.fill_(POISON)))
        with self._lock:  # (its next user on this stream is ordered after the fill; others must wait for it)
            self._cache.setdefault((tensor.numel(), stream.sid), []).append(block.tensor)

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        block = self._blocks.get(storage_ptr(tensor))
        if block is not None:
            with self._lock:
                block.recorded.add(stream)
        else:
            self.clocks.protect(storage_ptr(tensor), stream.sid)
            self._unrecorded.pop((storage_ptr(tensor), stream.sid), None)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream()
        pinned = self.is_pinned(dst) or self.is_pinned(src)
        if not pinned and not stream.synchronous:
            self.pageable_copies += 1  # (CUDA copies through pageable memory synchronously)
            done = self.event()
            done.record(stream)
            done.synchronize()
        if not stream.synchronous and storage_ptr(src) not in self._blocks and not self.is_pinned(src) \
                and self._made_on.get(storage_ptr(src)) != stream.sid:  # (made on this stream: ordered)
            # device memory of torch's allocator (a gradient) read on a side stream: without
            # record_stream the allocator may give it to the next tensor while the copy reads
            self._unrecorded[(storage_ptr(src), stream.sid)] = stream.name
        with stream.order:
            self.clocks.access(stream.sid, storage_ptr(src), write=False, what="a copy's read")
            self.clocks.access(stream.sid, storage_ptr(dst), write=True, what="a copy's write")
            if stream.synchronous or not pinned:
                with self._quiet():
                    dst.copy_(src)
            else:
                stream.submit(self._quietly(lambda: dst.copy_(src)))

    def pin(self, address: int, nbytes: int) -> bool:
        with self._lock:
            self._pinned[address] = nbytes
        return True

    def unpin(self, address: int) -> None:
        with self._lock:
            self._pinned.pop(address, None)
        self.clocks.forget(address)

    def is_pinned_ptr(self, ptr: int) -> bool:
        with self._lock:
            return any(a <= ptr < a + n for a, n in self._pinned.items())

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.is_pinned_ptr(t.data_ptr())

    def allocated_bytes(self) -> int:
        return self.allocated

    # -- compute on the thread that runs the model (races.ComputeAccesses) ---------------------
    def _operator(self, func, reads: list[int], writes: list[int], fresh: list[int]) -> None:
        """Note: what CUDA would make of the operator. One that touches pinned host memory is
        host work, done when it returns. ``copy_`` between device memory (a block) and other
        memory is taken for a copy between host and device without ``non_blocking``, which
        CUDA runs synchronously. Either, where it touches memory that is not pinned, first
        waits for the compute stream (a synchronous copy does). Any other operator is a
        kernel queued on the compute stream. (A tensor the simulator did not allocate may
        stand for host or device memory; a device-to-device ``copy_`` into a block is taken
        for host work too, which can only hide a race, never invent one.)"""
        if getattr(self._local, "quiet", False):
            return
        touched = reads + writes
        pinned = [self.is_pinned_ptr(p) for p in touched]
        blocks = sum(p in self._blocks for p in touched)
        host = any(pinned) or (func is torch.ops.aten.copy_.default and blocks == 1 and len(touched) == 2)
        if not host:  # a kernel, on the thread's current stream (the compute stream unless using() one)
            sid = self.current_stream().sid
            for ptr in fresh:  # (new memory: what was at that address before is not its history)
                self.clocks.allocated(ptr, sid)
                self.clocks.forget(ptr)
                self._made_on[ptr] = sid
                self.clocks.access(sid, ptr, write=True, what=f"{func}'s result")
            for ptr in reads:
                self.clocks.access(sid, ptr, write=False, what=f"{func} reading")
            for ptr in writes:
                self.clocks.access(sid, ptr, write=True, what=f"{func} writing")
            return
        if not all(pinned):
            self.clocks.observe(self.clocks.snapshot(self.compute.sid))
        for ptr in reads:
            self.clocks.access(HOST, ptr, write=False, what=f"host {func} reading")
        for ptr in fresh:  # (host memory and device memory never share an address on a device)
            self.clocks.forget(ptr)
        for ptr in writes + fresh:
            self.clocks.access(HOST, ptr, write=True, what=f"host {func} writing")

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        before = getattr(self._local, "quiet", False)
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = before

    def _quietly(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with self._quiet():
                fn()
        return run

    # -- for tests --------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every stream has run what was queued on it."""
        for s in list(self.streams):
            done = self.event()
            done.record(s)
            done.synchronize()

    def close(self) -> None:
        self.drain()
        for s in self.streams:
            s.close()
        self._cache.clear()
        for (ptr, _), name in self._unrecorded.items():
            self.errors.append(RaceError(
                f"memory at {ptr:#x} that the simulator did not allocate (a gradient) was read by a copy on "
                f"the {name} stream without record_stream on that stream: CUDA's caching allocator could "
                "hand it to the next tensor while the copy still reads it"))


@contextlib.contextmanager
def simulated(**kwargs) -> Iterator[SimAccelerator]:
    """Run the block with the CPU device simulated as ``SimAccelerator(**kwargs)``; raise what
    a stream's work raised."""
    from offload.accel import simulate

    acc = SimAccelerator(**kwargs)
    try:
        with simulate(acc), acc.accesses:
            yield acc
    finally:
        acc.close()
    problems = acc.errors + acc.clocks.races
    if problems:
        raise problems[0]
