"""Fixtures of the store tests: ``FakeTier``, an in-memory slow tier whose transfers the
test completes by hand, and ``make_store``, the usual store around one."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from offload.io import BufferPool
from offload.store import Completion, HostMemoryTier, Pending, TensorStore, Tier, TierBackend

KB = 4096  # one slot of the host-memory tiers (page rounded)


class FakeTier(TierBackend):
    """An in-memory stand-in for a slow tier, for schedule tests.

    Every operation is appended to ``log`` as a tuple. With ``manual=True`` transfers stay
    in flight until the test calls ``complete(n)``; ``fail_reads`` / ``fail_writes`` make
    the next transfers fail with the given exception.
    """

    def __init__(self, tier: Tier = Tier.NVME, budget: int = 1 << 40, *, manual: bool = False,
                 log: list | None = None):
        super().__init__(tier, budget)
        self.manual = manual
        self.log = log if log is not None else []
        self.fail_reads: list[BaseException] = []
        self.fail_writes: list[BaseException] = []
        self._pending: list[tuple[Callable[[], None], "_FakeCompletion"]] = []
        self._next = 0

    def allocate(self, nbytes: int) -> dict | None:
        if not self._claim(nbytes):
            return None
        self._next += 1
        self.log.append(("allocate", self.tier.value, self._next, nbytes))
        return {"id": self._next, "data": bytearray(nbytes)}

    def free(self, slot: dict) -> None:
        self.log.append(("free", self.tier.value, slot["id"]))
        self._unclaim(len(slot["data"]))

    def read_into(self, slot: dict, dest: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        self.log.append(("read", self.tier.value, slot["id"], nbytes))
        error = self.fail_reads.pop(0) if self.fail_reads else None

        def move() -> None:
            if nbytes:
                dest[:nbytes].copy_(torch.frombuffer(slot["data"], dtype=torch.uint8, count=nbytes))

        self._count(read=nbytes)
        return self._run(move, error)

    def write_from(self, slot: dict, src: torch.Tensor, nbytes: int, *, priority: int = 1) -> Completion:
        self.log.append(("write", self.tier.value, slot["id"], nbytes))
        error = self.fail_writes.pop(0) if self.fail_writes else None
        data = src[:nbytes].clone()  # what a DMA engine would have read at issue time

        def move() -> None:
            slot["data"][:nbytes] = bytes(data.numpy())

        self._count(write=nbytes)
        return self._run(move, error)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def complete(self, n: int | None = None) -> None:
        """Finish the ``n`` oldest transfers in flight (all when ``None``)."""
        count = len(self._pending) if n is None else n
        for _ in range(count):
            move, completion = self._pending.pop(0)
            completion._complete(move)

    def _run(self, move: Callable[[], None], error: BaseException | None) -> Completion:
        completion = _FakeCompletion(error)
        if self.manual:
            self._pending.append((move, completion))
        else:
            completion._complete(move)
        return completion


class _FakeCompletion(Pending):
    def __init__(self, error: BaseException | None):
        super().__init__()
        self._planned_error = error

    def _complete(self, move: Callable[[], None]) -> None:
        if self._planned_error is None:
            move()
        self._finish(self._planned_error)


@pytest.fixture
def fake_tier() -> type[FakeTier]:
    """The FakeTier class, to build tiers with."""
    return FakeTier


@pytest.fixture
def make_store() -> Callable[..., tuple[TensorStore, FakeTier, list]]:
    """``make_store(device_slots=4, host_slots=16, manual=True)`` -> ``(store, fake, log)``:
    host-memory DEVICE and HOST tiers of that many 4 KiB slots and a FakeTier as NVME."""
    def make(*, device_slots: int = 4, host_slots: int = 16, manual: bool = True):
        log: list = []
        fake = FakeTier(Tier.NVME, manual=manual, log=log)
        host_pool = BufferPool(host_slots * KB, name="host")
        tiers = {
            Tier.DEVICE: HostMemoryTier(Tier.DEVICE, BufferPool(device_slots * KB, name="device")),
            Tier.HOST: HostMemoryTier(Tier.HOST, host_pool),
            Tier.NVME: fake,
        }
        return TensorStore(tiers, staging=host_pool), fake, log

    return make
