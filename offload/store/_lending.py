"""Lending a stored tensor's bytes without a copy in any tier: read into the caller's
buffer, borrow a resting host slot, view the NVMe file mapping, overwrite the home copy
in place. Each holds the copy it lends (not dropped, its slot not reused) until the
caller's ``release()`` / ``done()``.

Part of :class:`~offload.store.TensorStore` (a mixin: the store keeps the records and
the lock).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .._signals import DEFER, wait as _wait
from ._inplace import CheckpointSlot
from ._records import lost_error
from ._state import Residency, StoreError, Tier
from ._tiers import Done, Pending
from ._transfers import start_transfer

__all__ = ["Lending"]


@contextmanager
def _handing_out(release: Any) -> Iterator[list[bool]]:
    """A loan's section: once the copy is held (``held.append(True)``), anything that ends the
    section with an exception (a Ctrl-C held back by DEFER is delivered as its locked
    section closes) returns the loan, since the caller will never see ``release`` to call
    it."""
    held: list[bool] = []  # a flag, cheap enough for the per-group map_view of the mmap path
    try:
        yield held
    except BaseException:  # re-raised: only the loan is returned on the way out
        if held:
            release()
        raise


class Lending:
    """Reads out of a TensorStore, and loans of its copies' slots."""

    def read_copy(self, key: str) -> torch.Tensor:
        """A copy of ``key``'s current bytes in ordinary host memory. A tensor resting in a
        slower tier is fetched into the HOST tier for this, and that copy dropped again."""
        with DEFER, self._cond:
            home = self._record(key).home
        if home is not Tier.NVME:
            return self.wait(key, home).to("cpu", copy=True)
        self.fetch(key, Tier.HOST)
        out = self.wait(key, Tier.HOST).clone()
        self.evict(key, Tier.HOST)
        return out

    def read_into(self, key: str, dest: torch.Tensor, *, priority: int = 1) -> Any:
        """Start copying ``key``'s current bytes into ``dest`` (a contiguous uint8 host
        tensor of at least ``nbytes``, page aligned for a direct read); returns a completion
        (``wait()`` raises the transfer's error). The bytes come from the fastest copy that
        holds the newest version, read in place: no copy is made in any tier, so this needs
        no budget, and that copy cannot be dropped until the transfer ends."""
        with DEFER:  # a Ctrl-C is delivered once the callback that ends the hold is attached
            with self._cond:
                record = self._record(key)
                if record.lost is not None:
                    raise lost_error(record) from record.lost
                if dest.numel() < record.nbytes:
                    raise ValueError(f"read_into({key!r}): destination holds {dest.numel()} bytes, "
                                     f"the tensor {record.nbytes}")
                while True:
                    source = self._source(record, exclude=None)
                    if source is not None:
                        break
                    if not any(c.state is Residency.LOADING for c in record.copies.values()):
                        raise StoreError(f"tensor {key!r} has no copy holding its newest bytes")
                    _wait(self._cond)
                if record.nbytes == 0:
                    return Done()
                source.readers += 1
                self._in_flight += 1
                backend = self.tiers[source.tier]
            completion, interrupt = start_transfer(
                lambda: backend.read_into(source.slot, dest, record.nbytes, priority=priority), f"read_into of {key!r}")
            done = Pending()

            def finished(c: Any) -> None:
                with DEFER, self._cond:
                    self._in_flight -= 1
                    self._reader_done(record, source)
                    self._pump_all()
                    self._cond.notify_all()
                done._finish(c.exception())

            completion.add_done_callback(finished)
        if interrupt is not None:
            raise interrupt
        return done

    def borrow_host(self, key: str) -> tuple[torch.Tensor, Any] | None:
        """``(view, release)`` of ``key``'s newest bytes when a copy holding them is in host
        memory (a HOST slot, or a DEVICE slot on a CPU device), else None. The copy is held
        (not dropped, its slot not reused) until ``release()`` is called; the caller must
        not change it. Lets a writer send resting bytes to a file without copying them."""
        def release() -> None:
            with DEFER, self._cond:
                self._reader_done(record, source)
                self._pump_all()
                self._cond.notify_all()

        with _handing_out(release) as held:
            with DEFER, self._cond:
                record = self._record(key)
                source = self._source(record, exclude=None)
                if source is None or record.nbytes == 0 or not self.tiers[source.tier].addressable:
                    return None
                source.readers += 1
                held.append(True)
                view = self.tiers[source.tier].tensor(source.slot)[: record.nbytes]
        return view, release

    def map_view(self, key: str) -> tuple[torch.Tensor, Any] | None:
        """``(view, release)``: ``key``'s bytes seen in place through the NVMe tier's file
        mapping (``io_backend="mmap"``), when that copy holds the newest bytes and no other
        copy does; else None. No copy is made: pages come from the page cache (or the disk,
        on first touch). The copy is held (not rewritten, not freed) until ``release()``;
        the caller must not write the view. A CPU device computes on such views directly."""
        def release() -> None:
            with DEFER, self._cond:
                self._reader_done(record, nvme)
                self._pump_all()
                self._cond.notify_all()

        with _handing_out(release) as held:
            with DEFER, self._cond:
                record = self._record(key)
                nvme = record.copies.get(Tier.NVME)
                backend = self.tiers.get(Tier.NVME)
                if nvme is None or not hasattr(backend, "view") or record.nbytes == 0 \
                        or isinstance(nvme.slot, CheckpointSlot) \
                        or self._source(record, exclude=None) is not nvme or nvme.state is not Residency.RESIDENT:
                    return None
                view = backend.view(nvme.slot, record.nbytes)
                nvme.readers += 1
                held.append(True)
        return view, release

    def advise(self, key: str) -> None:
        """Ask the NVMe tier to start reading ``key`` into the page cache (``io_backend="mmap"``;
        a no-op otherwise): the prefetch of :meth:`map_view`."""
        with DEFER, self._cond:
            record = self._record(key)
            nvme = record.copies.get(Tier.NVME)
            backend = self.tiers.get(Tier.NVME)
            if nvme is None or not hasattr(backend, "advise") or nvme.state is not Residency.RESIDENT \
                    or isinstance(nvme.slot, CheckpointSlot):
                return
            backend.advise(nvme.slot, record.nbytes)

    def overwrite_in_place(self, key: str) -> tuple[torch.Tensor, Any] | None:
        """``(view, done)`` of ``key``'s home copy when it rests in host memory (a HOST
        slot, or a DEVICE slot on a CPU device), else None. Other copies are dropped and
        transfers touching the home copy waited for; the caller writes the new bytes into
        ``view`` and calls ``done()``. Lets a reader fill resting bytes from a file
        without a second copy."""
        def done() -> None:
            with DEFER, self._cond:
                home.valid, home.dirty = True, False
                self._reader_done(record, home)
                self._pump_all()
                self._cond.notify_all()

        with _handing_out(done) as held:
            with DEFER, self._cond:
                record = self._record(key)
                home = record.copies.get(record.home)
                if not self.tiers[record.home].addressable or record.nbytes == 0 or home is None:
                    return None
                busy = (Residency.LOADING, Residency.STORING)
                while any(c.state in busy for c in record.copies.values()) or home.readers:
                    _wait(self._cond)
                if home.state is not Residency.RESIDENT:
                    return None
                for other in list(record.copies.values()):
                    if other is not home and other.state is Residency.RESIDENT:
                        other.valid = False
                        self._drop(record, other)
                    elif other is not home and other.state is Residency.QUEUED:
                        self._queues[other.tier].remove((record, other))
                        self._move(record, other, Residency.ABSENT)
                        self._release(record, other)
                home.readers += 1  # nothing frees or reuses the slot while the caller writes
                held.append(True)
                record.version += 1
                view = self.tiers[record.home].tensor(home.slot)[: record.nbytes]
        return view, done
