"""Copies held back (``hold_back``): a changed host copy that stays, read from there, written
home once (at ``flush_behind``, ``shed_behind`` oldest first, or an ``evict``)."""

from __future__ import annotations

import torch

from offload.store import Residency, Tier

from conftest import FakeTier  # noqa: F401  (tests/store is on the path: no package)


def held(store, fake, n):
    """``n`` tensors on the fake NVMe tier, each read into host memory, changed and held back."""
    for i in range(n):
        store.put(f"t{i}", torch.full((1000,), float(i)), Tier.NVME)
    fake.complete()
    for i in range(n):
        store.fetch(f"t{i}", Tier.HOST)
    fake.complete()
    for i in range(n):
        store.wait(f"t{i}", Tier.HOST).add_(100)
        store.hold_back(f"t{i}", Tier.HOST)


def test_a_held_copy_is_read_from_memory_and_written_home_once_when_flushed(make_store):
    store, fake, log = make_store()
    held(store, fake, 1)
    log.clear()
    assert store.held_back("t0") and store.behind_bytes == 4000
    store.fetch("t0", Tier.DEVICE)  # (the device copy comes from the held one: nothing read)
    assert torch.equal(store.wait("t0", Tier.DEVICE), torch.full((1000,), 100.0)) and log == []
    store.evict("t0", Tier.DEVICE)
    store.flush_behind("t0")
    assert log == [("write", "nvme", 1, 4000)] and not store.held_back("t0")
    fake.complete()
    assert store.state("t0", Tier.HOST) is Residency.ABSENT and store.behind_bytes == 0
    store.flush_behind("t0")  # (nothing held: nothing written)
    store.fetch("t0", Tier.HOST)
    fake.complete()
    assert torch.equal(store.wait("t0", Tier.HOST), torch.full((1000,), 100.0))


def test_shedding_writes_the_oldest_first_and_a_copy_changed_again_is_the_newest(make_store):
    store, fake, log = make_store()
    held(store, fake, 3)
    store.wait("t0", Tier.HOST).add_(1)
    store.hold_back("t0", Tier.HOST)  # (held again: now after t1 and t2)
    log.clear()
    assert store.shed_behind(5000) == 8000  # two copies: t1, then t2
    assert [entry[:3] for entry in log] == [("write", "nvme", 2), ("write", "nvme", 3)]
    assert store.held_back("t0") and not store.held_back("t1")
    store.flush_all_behind()
    fake.complete()
    assert store.behind_bytes == 0
    for i, want in ((0, 101.0), (1, 101.0), (2, 102.0)):
        store.fetch(f"t{i}", Tier.HOST)
        fake.complete()
        assert torch.equal(store.wait(f"t{i}", Tier.HOST), torch.full((1000,), want))


def test_an_evicted_or_deleted_held_copy_is_no_longer_held(make_store):
    store, fake, log = make_store()
    held(store, fake, 2)
    store.evict("t0", Tier.HOST)  # (written home like any changed copy)
    fake.complete()
    store.delete("t1")
    assert not store.held_back("t0") and not store.held_back("t1") and store.behind_bytes == 0
    log.clear()
    store.flush_all_behind()
    assert log == []


def test_a_fetch_short_of_room_writes_held_copies_home_instead_of_failing(make_store):
    """Held copies fill the host tier; a fetch into it, with nothing else in flight that could
    free room, starts their writes (oldest first) and waits for them rather than raising."""
    store, fake, log = make_store(host_slots=3)
    store.put("t3", torch.full((1000,), 3.0), Tier.NVME)
    fake.complete()
    held(store, fake, 3)
    store.fetch("t3", Tier.HOST)
    assert store.state("t3", Tier.HOST) is Residency.QUEUED
    fake.manual = False  # (the writes the wait starts land at once)
    assert torch.equal(store.wait("t3", Tier.HOST), torch.full((1000,), 3.0))
    assert not store.held_back("t0") and store.held_back("t2")
    store.flush_all_behind()
    store.fetch("t0", Tier.HOST)
    assert torch.equal(store.wait("t0", Tier.HOST), torch.full((1000,), 100.0))
