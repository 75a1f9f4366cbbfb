"""Stream-order race detection for the simulated device: vector clocks, as CUDA's own
sanitizer (``torch.cuda._sanitizer``) keeps them.

Every stream counts the work queued on it; an event carries the counts its stream (and
all it waited for) had reached when recorded; ``wait_event`` merges them into the waiting
stream; a host-side ``synchronize`` into the ``floor``, what every later piece of work is
ordered after. Each access to memory is checked where it is queued, against the last
write and the reads since: an access is a race unless its stream (or the floor) has
passed them. Checked where queued, not where run: a missing wait shows whether or not the
delays happen to expose it, unless the host had synchronized that work already on another
thread (which on CUDA orders all later work too).

Operators on the thread that runs the model (``ComputeAccesses``) are sorted by the
simulator as CUDA would run them (``SimAccelerator._operator``).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST = 0  # the stream id of host work
# name the code of both accesses of a race: "all", or "side" (not the compute stream's: faster)
_STACKS = os.environ.get("SIMDEVICE_STACKS", "")


class RaceError(AssertionError):
    pass


@dataclass
class _Memory:
    last_write: tuple[int, int, str] | None = None  # (stream, its count then, what)
    reads: dict[int, tuple[int, str]] = field(default_factory=dict)  # since the last write


class Clocks:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.names: dict[int, str] = {HOST: "host"}
        self.floor: dict[int, int] = {HOST: 0}
        self._vc: dict[int, dict[int, int]] = {HOST: self.floor}
        self._memory: dict[int, _Memory] = {}
        self._protected: dict[int, list[int]] = {}  # ptr -> streams recorded on that memory
        self.races: list[RaceError] = []

    def add_stream(self, sid: int, name: str) -> None:
        with self.lock:
            self.names[sid] = name
            self._vc[sid] = {sid: 0}

    def tick(self, sid: int) -> None:
        with self.lock:
            self._vc[sid][sid] += 1

    def snapshot(self, sid: int) -> dict[int, int]:
        with self.lock:
            out = dict(self.floor)
            for other, count in self._vc[sid].items():
                out[other] = max(count, out.get(other, 0))
            return out

    def merge(self, sid: int, seen: dict[int, int]) -> None:
        with self.lock:
            vc = self._vc[sid]
            for other, count in seen.items():
                if count > vc.get(other, 0):
                    vc[other] = count

    def observe(self, seen: dict[int, int]) -> None:
        """The host saw work complete (a synchronize): all later work is ordered after it."""
        self.merge(HOST, seen)

    def access(self, sid: int, ptr: int, *, write: bool, what: str) -> None:
        """``sid`` reads (or writes) the memory whose storage starts at ``ptr``, in its order now."""
        if _STACKS == "all" or (_STACKS == "side" and self.names.get(sid) != "compute"):
            what += "\n" + "".join(traceback.format_stack(limit=14)[:-2])
        elif _STACKS == "cheap":
            what += " [" + _offload_frames() + "]"
        with self.lock:
            vc = self._vc[sid]
            vc[sid] += 1
            mem = self._memory.setdefault(ptr, _Memory())
            earlier = [mem.last_write] if mem.last_write else []
            if write:
                earlier += [(s, c, w) for s, (c, w) in mem.reads.items()]
            for other, count, did in earlier:
                seen = max(vc.get(other, 0), self.floor.get(other, 0))
                if other != sid and other != HOST and seen < count:
                    self.races.append(RaceError(
                        f"{what} on the {self.names[sid]} stream is not ordered after {did} on the "
                        f"{self.names[other]} stream (memory at {ptr:#x}): a wait_event, wait_stream, fence "
                        "or record_stream is missing"))
            if write:
                mem.last_write, mem.reads = (sid, vc[sid], what), {}
            else:
                mem.reads[sid] = (vc[sid], what)

    def protect(self, ptr: int, sid: int) -> None:
        """``record_stream`` of memory the simulator did not allocate (a gradient): its next
        allocation waits for ``sid``'s work queued by then, as the caching allocator would."""
        with self.lock:
            self._protected.setdefault(ptr, []).append(sid)

    def allocated(self, ptr: int, sid: int) -> None:
        """Memory at ``ptr`` was just allocated for ``sid``'s work."""
        with self.lock:
            for other in self._protected.pop(ptr, []):
                self.merge(sid, self.snapshot(other))

    def forget(self, ptr: int) -> None:
        with self.lock:
            self._memory.pop(ptr, None)
            self._protected.pop(ptr, None)


def _offload_frames(depth: int = 40, keep: int = 5) -> str:
    frame, out = sys._getframe(2), []
    while frame is not None and depth and len(out) < keep:
        code = frame.f_code
        if "/offload/" in code.co_filename:
            out.append(f"{code.co_filename.rsplit('/offload/', 1)[1]}:{frame.f_lineno} {code.co_name}")
        frame, depth = frame.f_back, depth - 1
    return " < ".join(out)


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class ComputeAccesses(TorchDispatchMode):
    """Hands each operator of this thread to ``report(func, reads, writes, fresh)``: the
    storages it reads, writes, and creates (views touch none and are not reported)."""

    def __init__(self, report: Callable[[Any, list, list, list], None]):
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return func(*args, **kwargs)  # a view: no memory is touched
        if func.overloadpacket is torch.ops.aten.set_:
            return func(*args, **kwargs)  # points a tensor at other memory: touches none (no kernel on CUDA)
        reads, writes, fresh = [], [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                    (writes if write else reads).append(storage_ptr(t))
        out = func(*args, **kwargs)
        for ret, value in zip(schema.returns, out if isinstance(out, (tuple, list)) else [out]):
            if ret.alias_info is None:  # a new tensor (not a view of an argument)
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                        fresh.append(storage_ptr(t))
        if reads or writes or fresh:
            self.report(func, reads, writes, fresh)
        return out
