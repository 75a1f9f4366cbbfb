"""Aligned host buffers and their pool."""

from __future__ import annotations

import gc
import logging
import random
import threading
import weakref

import pytest
import torch

from offload.io import PAGE_SIZE, BudgetError, BufferPool, HostBuffer, pool_bytes
from offload.io import _buffers as buffers_module


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 10**6])
def test_buffers_are_page_aligned_and_rounded(nbytes):
    buf = HostBuffer(nbytes)
    assert buf.address % 4096 == 0 and buf.address % PAGE_SIZE == 0
    assert buf.nbytes >= max(nbytes, 1) and buf.nbytes % PAGE_SIZE == 0
    assert buf.bytes.data_ptr() == buf.address and not buf.pinned


def test_view_shares_memory_with_any_dtype():
    buf = HostBuffer(64)
    v = buf.view(torch.bfloat16, (4, 2))
    v.fill_(1.5)
    assert torch.equal(buf.bytes[:16].view(torch.bfloat16), torch.full((8,), 1.5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        buf.view(torch.float64, (1024,))


def test_pool_reuses_and_counts_held_bytes():
    pool = BufferPool(4 * PAGE_SIZE)
    a = pool.acquire(PAGE_SIZE)
    pool.release(a)
    b = pool.acquire(100)
    assert b is a  # same size class comes back
    assert pool.held_bytes == PAGE_SIZE and pool.in_use_bytes == PAGE_SIZE


def test_pool_drops_cached_buffers_to_make_room():
    pool = BufferPool(4 * PAGE_SIZE)
    small = [pool.acquire(PAGE_SIZE) for _ in range(4)]
    for buf in small:
        pool.release(buf)
    big = pool.acquire(3 * PAGE_SIZE)  # needs three cached pages dropped
    assert big.nbytes == 3 * PAGE_SIZE and pool.held_bytes <= pool.budget
    assert pool.peak_bytes <= pool.budget


def test_pool_refuses_what_can_never_fit():
    pool = BufferPool(2 * PAGE_SIZE, name="host")
    with pytest.raises(BudgetError, match=r"can never fit the host budget"):
        pool.acquire(3 * PAGE_SIZE)


def test_pool_waits_for_release_and_times_out_clearly():
    pool = BufferPool(PAGE_SIZE)
    held = pool.acquire(1)
    assert pool.try_acquire(1) is None
    with pytest.raises(BudgetError, match="not free within"):
        pool.acquire(1, timeout=0.01)
    releaser = threading.Timer(0.01, pool.release, args=(held,))
    releaser.start()
    assert pool.acquire(1, timeout=30) is held
    releaser.join()


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE_SIZE


def test_a_pool_that_leaves_faulting_to_first_use_holds_its_budget_but_not_its_pages():
    """fault_in=False: the pages of a new buffer become resident as its first use writes
    them (a read into it), not when the pool hands it out; the budget counts it either way."""
    size = 64 << 20
    eager, lazy = BufferPool(size, name="eager"), BufferPool(size, name="lazy", fault_in=False)
    try:
        before = _rss()
        a = eager.acquire(size)  # (kept: a buffer nobody holds is unmapped)
        grown = _rss() - before
        before = _rss()
        b = lazy.acquire(size)
        assert grown >= size // 2 and _rss() - before < size // 4
        assert lazy.held_bytes == eager.held_bytes == size
        b.bytes.fill_(7)
        assert _rss() - before >= size // 2 and bool((b.bytes == 7).all()) and a.nbytes == size
    finally:
        eager.close()
        lazy.close()


def test_a_cpu_devices_pool_leaves_faulting_to_the_read_and_the_host_pool_does_not():
    from offload.store import Tier, create_store

    store = create_store(device="cpu", device_budget="8MiB", host_budget="8MiB")
    try:
        assert store.tiers[Tier.DEVICE].pool.fault_in is False and store.tiers[Tier.HOST].pool.fault_in is True
    finally:
        store.close()


@pytest.mark.parametrize("nbytes", [4096, 4 << 20])  # (ordinary pages; huge pages asked for)
def test_a_closed_buffer_stays_mapped_while_a_tensor_views_it(nbytes):
    """A view that outlives close() (a traceback's frame, a caller's reference) reads its
    bytes, not unmapped memory; the mapping goes when the last view does."""
    buf = HostBuffer(nbytes)
    view = buf.view(torch.int32, (16,))
    view.copy_(torch.arange(16, dtype=torch.int32))
    mapping = weakref.ref(buf._map)
    buf.close()
    assert torch.equal(view, torch.arange(16, dtype=torch.int32))
    assert mapping() is not None
    del view
    gc.collect()
    assert mapping() is None  # unmapped with the last view


def test_a_full_pool_resizes_a_cached_buffer_for_another_size():
    """A request of another size, with the budget held by cached buffers, gets one of them
    resized in place (the pages both sizes share kept, nothing mapped anew): a smaller one
    grown, with another dropped for the room, or a larger one shrunk."""
    pool = BufferPool(8 * PAGE_SIZE, fault_in=False)
    bufs = [pool.acquire(2 * PAGE_SIZE) for _ in range(4)]
    for i, buf in enumerate(bufs):
        buf.bytes.fill_(i + 1)
        pool.release(buf)
    big = pool.acquire(3 * PAGE_SIZE)
    assert (pool.mapped, pool.resized) == (4, 1) and big.nbytes == 3 * PAGE_SIZE
    mark = next(i + 1 for i, buf in enumerate(bufs) if buf is big)
    assert bool((big.bytes[:2 * PAGE_SIZE] == mark).all()) and bool((big.bytes[2 * PAGE_SIZE:] == 0).all())
    assert pool.held_bytes == 7 * PAGE_SIZE and pool.peak_bytes <= pool.budget
    pool.release(big)
    pool.trim()
    whole = pool.acquire(8 * PAGE_SIZE)
    whole.bytes.fill_(9)
    pool.release(whole)
    one = pool.acquire(PAGE_SIZE)  # (8 pages is more than twice 1: shrunk rather than lent whole)
    assert one is whole and one.nbytes == PAGE_SIZE and pool.held_bytes == PAGE_SIZE
    assert bool((one.bytes == 9).all()) and (pool.mapped, pool.resized) == (5, 2)
    pool.close()


def test_a_viewed_or_pinned_buffer_is_not_resized():
    """A cached buffer a tensor still views is dropped and a new one mapped, not moved
    under the view; a pinned pool's buffers keep their registered pages."""
    pool = BufferPool(3 * PAGE_SIZE)
    held = pool.acquire(2 * PAGE_SIZE)
    view = held.view(torch.int32, (16,))
    view.copy_(torch.arange(16, dtype=torch.int32))
    pool.release(held)
    assert pool.acquire(3 * PAGE_SIZE).nbytes == 3 * PAGE_SIZE
    assert (pool.mapped, pool.resized) == (2, 0) and torch.equal(view, torch.arange(16, dtype=torch.int32))
    pool.close()
    kept = HostBuffer(PAGE_SIZE)  # (the whole tensor, its storage or a memoryview kept count too)
    for held in (lambda: kept.bytes, lambda: kept.bytes.untyped_storage(), lambda: kept.memoryview()):
        holder = held()
        assert kept.resize(2 * PAGE_SIZE) is False and kept.nbytes == PAGE_SIZE
        del holder
    assert kept.resize(2 * PAGE_SIZE) is True and kept.bytes.numel() == 2 * PAGE_SIZE

    class Pins:  # an accelerator that registers host pages
        def pin(self, address, nbytes):
            return True

        def unpin(self, address):
            pass

    pinned = BufferPool(3 * PAGE_SIZE, pin=Pins())
    pinned.release(pinned.acquire(2 * PAGE_SIZE))
    assert pinned.acquire(3 * PAGE_SIZE).pinned and (pinned.mapped, pinned.resized) == (2, 0)
    pinned.close()
    assert HostBuffer(PAGE_SIZE, pin=Pins()).resize(2 * PAGE_SIZE) is False


def test_a_cached_buffer_a_tensor_still_views_is_not_handed_out(caplog, monkeypatch):
    """A buffer released while a view of it lives (a weight's view kept past its module's
    forward) is not handed out again while it does: the view keeps its bytes. It stays
    cached, reused once the view is gone; dropped for room meanwhile, it is left to the view
    and counted beside the pools until the view goes, and said once the view has lasted
    ``VIEW_GRACE_S`` (here 0)."""
    monkeypatch.setattr(buffers_module, "VIEW_GRACE_S", 0.0)
    pool = BufferPool(4 * PAGE_SIZE)
    held = pool.acquire(PAGE_SIZE)
    view = held.view(torch.int32, (16,))
    view.copy_(torch.arange(16, dtype=torch.int32))
    pool.release(held)
    other = pool.acquire(PAGE_SIZE)
    assert other is not held and (pool.mapped, pool.left_to_holders) == (2, 0)
    other.bytes.fill_(7)
    assert torch.equal(view, torch.arange(16, dtype=torch.int32))
    del view
    assert pool.acquire(PAGE_SIZE) is held and pool.mapped == 2
    pool.close()
    tight = BufferPool(PAGE_SIZE)
    held = tight.acquire(PAGE_SIZE)
    view = held.view(torch.int32, (16,))
    view.copy_(torch.arange(16, dtype=torch.int32))
    tight.release(held)
    with caplog.at_level(logging.WARNING, logger="offload"):
        other = tight.acquire(PAGE_SIZE)  # (no room beside it: dropped, left to the view)
        assert other is not held and (tight.mapped, tight.left_to_holders, tight.held_bytes) == (2, 1, PAGE_SIZE)
        tight.release(other)  # (the view outlived the grace: said now)
        assert tight.acquire(PAGE_SIZE) is other
    assert "dropped for room is still viewed" in caplog.text and tight.lasting_views == 1
    other.bytes.fill_(7)
    assert torch.equal(view, torch.arange(16, dtype=torch.int32))
    assert pool_bytes()["host (left to views)"] == PAGE_SIZE
    del view
    gc.collect()
    assert not pool_bytes().get("host (left to views)")
    tight.close()
    brief = BufferPool(PAGE_SIZE)  # (a view gone within the grace, as the releasing code's local: not said)
    held = brief.acquire(PAGE_SIZE)
    view = held.view(torch.int32, (16,))
    brief.release(held)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload"):
        other = brief.acquire(PAGE_SIZE)
        del view  # (by its reference count: no collection)
        brief.release(other)
    assert (brief.left_to_holders, brief.lasting_views) == (1, 0) and "still viewed" not in caplog.text
    brief.close()
    closing = BufferPool(PAGE_SIZE)  # (at close, what still views a buffer is expected: the
    held = closing.acquire(PAGE_SIZE)  # parameters of a model never unwrapped; no warning)
    view = held.view(torch.int32, (16,))
    closing.release(held)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload"):
        closing.close()
    assert closing.left_to_holders == 1 and "still viewed" not in caplog.text
    del view


def test_the_buffer_resized_is_the_one_that_makes_the_room():
    """Of the cached buffers, the one that makes the room with least to spare is resized,
    as it would have been dropped: a large one a step keeps reusing stays as it is."""
    pool = BufferPool(100 * PAGE_SIZE)
    large, small, busy = (pool.acquire(n * PAGE_SIZE) for n in (64, 4, 28))
    pool.release(large)
    pool.release(small)
    got = pool.acquire(8 * PAGE_SIZE)  # (4 pages short: the 4-page buffer grown, the 64-page one kept)
    assert got is small and pool.resized == 1 and pool.acquire(64 * PAGE_SIZE) is large
    assert pool.held_bytes == 100 * PAGE_SIZE and busy.nbytes == 28 * PAGE_SIZE
    pool.close()


def test_a_pool_of_mixed_sizes_stays_within_its_budget():
    """Random sizes acquired and released (resized, lent larger, dropped and mapped): every
    buffer at least as large as asked and writable, the budget never passed."""
    rng = random.Random(0)
    pool = BufferPool(16 * PAGE_SIZE, fault_in=False)
    held, views = [], []
    for _ in range(300):
        if held and (rng.random() < 0.5 or pool.in_use_bytes > 8 * PAGE_SIZE):
            buf = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.2:  # (a view kept past release: that buffer is not resized)
                views.append(buf.view(torch.uint8, (1,)))
            pool.release(buf)
            views = views[-3:]
            continue
        size = rng.choice([1, 2, 3, 5, 8]) * PAGE_SIZE - rng.randrange(2)
        buf = pool.try_acquire(size)
        if buf is not None:
            assert buf.nbytes >= size
            buf.bytes[size - 1] = 1
            held.append(buf)
        free = sum(n * len(bufs) for n, bufs in pool._free.items())
        assert pool.held_bytes <= pool.budget and pool._cached == free
        assert pool.in_use_bytes == sum(b.nbytes for b in held)
    assert pool.peak_bytes <= pool.budget and pool.resized > 0
    pool.close()
