"""The device tier on the simulated asynchronous device: fetch, evict, fence, slot reuse;
then the tier's and the store's stream-ordering promises one by one (each found necessary by
removing it: the closing note of issue 30)."""

from __future__ import annotations

import pytest
import torch

from offload.store import DeviceTier, Residency, Tier, create_store

MiB = 1 << 20


def _store(path, **kw):
    args = dict(device="cpu", device_budget="4MiB", host_budget="8MiB", nvme_path=str(path),
                file_size="8MiB", block_size="256KiB")
    args.update(kw)
    return create_store(**args)


def test_the_store_takes_the_device_paths(sim, tmp_path):
    with _store(tmp_path) as store:
        assert isinstance(store.tiers[Tier.DEVICE], DeviceTier)
        assert not store.tiers[Tier.DEVICE].addressable
        assert store.tiers[Tier.HOST].pool.pin is sim


def test_round_trip_through_pinned_staging(sim, tmp_path):
    expected = []
    with _store(tmp_path) as store:
        for i in range(20):  # more than the device holds: slots are freed and reused
            t = torch.randn(MiB // 4) + i
            expected.append(t * 2)
            store.put(f"t{i}", t, Tier.NVME)
            got = store.wait(f"t{i}", Tier.DEVICE)
            assert torch.equal(got, t)
            got.mul_(2)
            store.mark_dirty(f"t{i}", Tier.DEVICE)
            store.evict(f"t{i}", Tier.DEVICE)
            assert torch.equal(store.wait(f"t{i}", Tier.HOST), t * 2)
            store.evict(f"t{i}", Tier.HOST)
        for start in range(0, 20, 3):  # three fetches in flight at once, then used
            keys = [f"t{i}" for i in range(start, min(start + 3, 20))]
            for key in keys:
                store.fetch(key, Tier.DEVICE)
            for key in keys:
                assert torch.equal(store.wait(key, Tier.DEVICE), expected[int(key[1:])])
            for key in keys:
                store.evict(key, Tier.DEVICE)
    assert sim.pageable_copies == 0


# -- the tier's contract with its users, one stream-ordering rule per test -------------------
def _tier_and_pinned(sim, nbytes):
    from offload.io import BufferPool

    tier = DeviceTier(sim, 1 << 20)
    pool = BufferPool(1 << 20, pin=sim, name="test")
    return tier, pool, pool.acquire(nbytes)


def _close(tier, pool, *bufs):
    for buf in bufs:
        pool.release(buf)
    pool.close()
    tier.close()


def test_consume_makes_compute_wait_for_the_copy_in(slow_sim):
    """A slot used on the compute stream right after its copy was issued: ``consume`` orders
    the use after the copy (the store waits for the copy's completion anyway; this is the
    tier's own promise, which a store that hands slots out earlier would rely on)."""
    tier, pool, src = _tier_and_pinned(slow_sim, 4096)
    src.bytes.copy_(torch.arange(4096) % 251)
    slot = tier.allocate(4096)
    tier.write_from(slot, src.bytes, 4096)
    tier.consume(slot)
    assert torch.equal(tier.tensor(slot)[:4096].clone(), src.bytes[:4096])
    tier.free(slot)
    _close(tier, pool, src)


def test_a_copy_out_waits_for_the_compute_that_wrote_the_slot(slow_sim):
    """``fence`` after compute wrote a slot: the device-to-host copy waits for it."""
    tier, pool, dest = _tier_and_pinned(slow_sim, 4096)
    slot = tier.allocate(4096)
    tier.consume(slot)
    tier.tensor(slot)[:4096].fill_(7)  # a kernel on the compute stream
    tier.fence(slot)
    tier.read_into(slot, dest.bytes, 4096).wait()
    assert bool((dest.bytes[:4096] == 7).all())
    tier.free(slot)
    _close(tier, pool, dest)


def test_a_copy_in_waits_for_the_compute_still_reading_the_slot(slow_sim):
    """New bytes into a slot compute has just read: ``fence`` orders the copy after the read."""
    tier, pool, src = _tier_and_pinned(slow_sim, 4096)
    slot = tier.allocate(4096)
    tier.consume(slot)
    tier.tensor(slot)[:4096].fill_(1)
    total = int(tier.tensor(slot)[:4096].sum())  # a kernel reading the slot
    tier.fence(slot)
    src.bytes.fill_(2)
    tier.write_from(slot, src.bytes, 4096).wait()
    assert total == 4096
    tier.free(slot)
    _close(tier, pool, src)


@pytest.mark.parametrize("transfer", ["read_into", "write_from"])
def test_a_slot_freed_while_its_copy_runs_is_not_reused_under_it(slow_sim, transfer):
    """``free`` right after issuing a copy (what an evicted copy still in flight does): the
    memory is reused only after the copy, so the copy moves the right bytes."""
    tier, pool, host = _tier_and_pinned(slow_sim, 4096)
    slot = tier.allocate(4096)
    tier.consume(slot)
    tier.tensor(slot)[:4096].fill_(5)
    tier.fence(slot)
    if transfer == "read_into":
        done = tier.read_into(slot, host.bytes, 4096)
    else:
        host.bytes.fill_(9)
        done = tier.write_from(slot, host.bytes, 4096)
    tier.free(slot)
    done.wait()
    if transfer == "read_into":
        assert bool((host.bytes[:4096] == 5).all())
    _close(tier, pool, host)


def test_completion_means_the_bytes_have_landed(slow_sim):
    """A transfer's completion (the event watcher) reports only once the device has copied."""
    tier, pool, host = _tier_and_pinned(slow_sim, 4096)
    host.bytes.copy_(torch.arange(4096) % 13)
    slot = tier.allocate(4096)
    for _ in range(5):
        tier.write_from(slot, host.bytes, 4096).wait()
        out = pool.acquire(4096)
        tier.read_into(slot, out.bytes, 4096).wait()
        assert torch.equal(out.bytes[:4096], host.bytes[:4096])
        pool.release(out)
    tier.free(slot)
    _close(tier, pool, host)


# -- the store's side of it -----------------------------------------------------------------------
def test_a_copy_changed_in_place_is_read_after_the_change(slow_sim, tmp_path):
    """Compute changes a device copy, ``mark_dirty`` says so; a read of the newest bytes (a
    device-to-host copy) waits for that change (``mark_dirty`` fences the slot)."""
    from offload.io import BufferPool

    pool = BufferPool(1 << 20, pin=slow_sim, name="test")
    dest = pool.acquire(MiB // 4)
    with _store(tmp_path) as store:
        store.put("t", torch.zeros(MiB // 16), Tier.NVME)
        store.wait("t", Tier.DEVICE).fill_(3)  # a kernel on the compute stream
        store.mark_dirty("t", Tier.DEVICE)
        store.read_into("t", dest.bytes).wait()
        assert bool((dest.view(torch.float32, (MiB // 16,)) == 3).all())
    pool.release(dest)
    pool.close()


def test_eviction_writes_what_compute_wrote_last(slow_sim, tmp_path):
    """Changed again after ``mark_dirty``: ``evict`` fences the slot, so the copy home holds
    the last change."""
    with _store(tmp_path) as store:
        store.put("t", torch.zeros(MiB // 16), Tier.NVME)
        got = store.wait("t", Tier.DEVICE)
        got.fill_(3)
        store.mark_dirty("t", Tier.DEVICE)
        got.fill_(4)
        store.evict("t", Tier.DEVICE)
        assert bool((store.wait("t", Tier.HOST) == 4).all())


def test_wait_unread_waits_for_the_copies_reading_a_tensor(slow_sim, tmp_path):
    """``wait_unread`` (before an update writes a host copy in place) returns once no
    transfer reads that copy: the device copy made from it has landed."""
    with _store(tmp_path) as store:
        store.put("t", torch.ones(MiB // 16), Tier.HOST)
        store.fetch("t", Tier.DEVICE)
        store.wait_unread("t", Tier.HOST)
        assert store.state("t", Tier.DEVICE) is Residency.RESIDENT
        store.wait("t", Tier.HOST).fill_(2)
        store.mark_dirty("t", Tier.HOST)
        assert bool((store.wait("t", Tier.DEVICE) == 2).all())


def test_a_fresh_slot_waits_for_the_copies_its_memory_was_freed_under(slow_sim):
    """A slot freed while a copy into it ran is handed out again (in the copy stream's order);
    a use on another stream first (a gather on the compute stream) waits for that copy."""
    tier, pool, src = _tier_and_pinned(slow_sim, 4096)
    src.bytes.fill_(9)
    old = tier.allocate(4096)
    tier.write_from(old, src.bytes, 4096)
    tier.free(old)
    new = tier.allocate(4096)
    tier.consume(new)
    tier.tensor(new)[:4096].fill_(1)  # a kernel writing it first
    tier.fence(new)
    out = pool.acquire(4096)
    tier.read_into(new, out.bytes, 4096).wait()
    assert bool((out.bytes[:4096] == 1).all())
    tier.free(new)
    pool.release(out)
    _close(tier, pool, src)


def test_a_put_from_device_memory_is_read_after_its_copy(slow_sim, tmp_path):
    """``put`` of a tensor already on the device into the device tier is a copy on the
    compute stream; the store fences it, so a copy out waits for it."""
    from offload.io import BufferPool

    pool = BufferPool(1 << 20, pin=slow_sim, name="test")
    dest = pool.acquire(MiB // 4)
    with _store(tmp_path) as store:
        store.put("a", torch.full((MiB // 16,), 6.0), Tier.NVME)
        store.put("b", store.wait("a", Tier.DEVICE), Tier.DEVICE)  # device to device
        store.read_into("b", dest.bytes).wait()
        assert bool((dest.view(torch.float32, (MiB // 16,)) == 6).all())
        store.delete("b")
    pool.release(dest)
    pool.close()
