"""The store's state machine and schedule, on a fake slow tier whose transfers the test
completes by hand: no timing, no disk."""

from __future__ import annotations

import pytest
import torch

from offload.io import BudgetError, BufferPool
from offload.store import HostMemoryTier, Residency, StoreError, TensorStore, Tier

from conftest import FakeTier  # (tests/store is on the path: no package)

KB = 4096  # one slot of the host-memory tiers (page rounded)


def tensor(i: int) -> torch.Tensor:
    return torch.full((1000,), float(i))  # 4000 bytes: one 4 KiB slot


def put_all(store, fake, n):
    for i in range(n):
        store.put(f"t{i}", tensor(i), Tier.NVME)
    fake.complete()


def test_fetch_returns_at_once_and_wait_sees_the_bytes(make_store):
    store, fake, log = make_store()
    put_all(store, fake, 1)
    log.clear()
    store.fetch("t0", Tier.DEVICE)
    assert store.state("t0", Tier.DEVICE) is Residency.LOADING
    assert log == [("read", "nvme", 1, 4000)] and fake.in_flight == 1
    fake.complete()
    assert store.state("t0", Tier.DEVICE) is Residency.RESIDENT
    assert torch.equal(store.wait("t0", Tier.DEVICE), tensor(0))


def test_put_into_slow_tier_is_in_flight_until_complete(make_store):
    store, fake, _ = make_store()
    store.put("a", tensor(1), Tier.NVME)
    assert store.state("a", Tier.NVME) is Residency.LOADING
    store.fetch("a", Tier.DEVICE)  # chained behind the write
    assert store.state("a", Tier.DEVICE) is Residency.QUEUED
    fake.complete(1)  # the write lands; the read starts
    assert store.state("a", Tier.DEVICE) is Residency.LOADING
    fake.complete()
    assert torch.equal(store.wait("a", Tier.DEVICE), tensor(1))


def test_many_fetches_with_interleaved_evictions_and_deletes_stay_in_budget(make_store):
    store, fake, log = make_store(device_slots=4)
    put_all(store, fake, 10)
    for i in range(10):
        store.fetch(f"t{i}", Tier.DEVICE)
    states = [store.state(f"t{i}", Tier.DEVICE) for i in range(10)]
    assert states == [Residency.LOADING] * 4 + [Residency.QUEUED] * 6
    store.evict("t1", Tier.DEVICE)  # still loading: dropped when it lands
    store.delete("t5")  # queued: leaves the queue
    store.evict("t6", Tier.DEVICE)  # queued: leaves the queue
    fake.complete(2)  # t0 lands; t1 lands and is dropped -> t2.. start in order
    assert store.state("t1", Tier.DEVICE) is Residency.ABSENT
    assert store.state("t4", Tier.DEVICE) is Residency.LOADING
    assert store.state("t7", Tier.DEVICE) is Residency.QUEUED
    for i in (0, 2, 3, 4):
        fake.complete()
        assert torch.equal(store.wait(f"t{i}", Tier.DEVICE), tensor(i))
        store.evict(f"t{i}", Tier.DEVICE)
    fake.complete()
    for i in (7, 8, 9):
        assert torch.equal(store.wait(f"t{i}", Tier.DEVICE), tensor(i))
    assert "t5" not in store and store.state("t6", Tier.DEVICE) is Residency.ABSENT
    assert store.stats()["device"]["peak_bytes"] <= 4 * KB
    reads = [e[2] for e in log if e[0] == "read"]
    assert reads == [1, 2, 3, 4, 5, 8, 9, 10]  # slot ids of t0..t4, t7..t9: FIFO, none twice


def test_request_that_can_never_fit_raises_at_once(make_store):
    store, fake, _ = make_store(device_slots=2, host_slots=32)
    store.put("big", torch.zeros(5 * KB), Tier.HOST)
    with pytest.raises(BudgetError, match=r"'big' needs 81920 bytes in the device tier.*budget is 8192"):
        store.fetch("big", Tier.DEVICE)


def test_wait_that_would_deadlock_raises_instead(make_store):
    store, fake, _ = make_store(device_slots=2)
    put_all(store, fake, 3)
    store.fetch("t0", Tier.DEVICE)
    store.fetch("t1", Tier.DEVICE)
    fake.complete()
    store.fetch("t2", Tier.DEVICE)
    assert store.state("t2", Tier.DEVICE) is Residency.QUEUED
    with pytest.raises(BudgetError, match=r"'t2'.*nothing in flight will free any.*evict\(\)"):
        store.wait("t2", Tier.DEVICE, timeout=30)
    store.evict("t0", Tier.DEVICE)
    fake.complete()
    assert torch.equal(store.wait("t2", Tier.DEVICE), tensor(2))


def test_dirty_eviction_writes_home_and_a_refetch_revives_it(make_store):
    store, fake, log = make_store()
    put_all(store, fake, 1)
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    dev = store.wait("t0", Tier.DEVICE)
    dev.fill_(42)
    store.mark_dirty("t0", Tier.DEVICE)
    log.clear()
    store.evict("t0", Tier.DEVICE)
    assert store.state("t0", Tier.DEVICE) is Residency.STORING
    assert log == [("write", "nvme", 1, 4000)]
    store.fetch("t0", Tier.DEVICE)  # wanted again before the write finished: keep it
    assert store.state("t0", Tier.DEVICE) is Residency.RESIDENT
    fake.complete()
    assert store.state("t0", Tier.DEVICE) is Residency.RESIDENT
    store.evict("t0", Tier.DEVICE)  # clean now: dropped without a write
    assert store.state("t0", Tier.DEVICE) is Residency.ABSENT and fake.in_flight == 0
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    assert torch.equal(store.wait("t0", Tier.DEVICE), torch.full((1000,), 42.0))


def test_a_copy_revived_then_evicted_during_its_write_back_goes_when_the_write_ends(make_store):
    """The eviction waits for the write (it reads the copy); once the bytes are home the
    copy is dropped and its budget given back, not left resident for ever."""
    store, fake, log = make_store()
    put_all(store, fake, 1)
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    store.wait("t0", Tier.DEVICE).fill_(7)
    store.mark_dirty("t0", Tier.DEVICE)
    store.evict("t0", Tier.DEVICE)  # write home starts
    store.fetch("t0", Tier.DEVICE)  # revived while the write runs
    held = store.tiers[Tier.DEVICE].used_bytes
    assert held > 0
    store.evict("t0", Tier.DEVICE)  # wanted gone again, the first write still running
    fake.complete()  # both writes end
    assert fake.in_flight == 0
    assert store.state("t0", Tier.DEVICE) is Residency.ABSENT
    assert store.tiers[Tier.DEVICE].used_bytes == 0
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    assert torch.equal(store.wait("t0", Tier.DEVICE), torch.full((1000,), 7.0))


def test_a_write_back_of_an_older_version_does_not_clean_a_newer_one(make_store):
    store, fake, log = make_store()
    put_all(store, fake, 1)
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    store.wait("t0", Tier.DEVICE).fill_(1)
    store.mark_dirty("t0", Tier.DEVICE)
    store.evict("t0", Tier.DEVICE)  # writes version 1
    store.wait("t0", Tier.DEVICE).fill_(2)  # revived and changed again
    store.mark_dirty("t0", Tier.DEVICE)
    fake.complete()  # version 1 lands
    log.clear()
    store.evict("t0", Tier.DEVICE)
    assert log == [("write", "nvme", 1, 4000)]  # version 2 still had to be written
    fake.complete()
    store.fetch("t0", Tier.HOST)
    fake.complete()
    assert torch.equal(store.wait("t0", Tier.HOST), torch.full((1000,), 2.0))


def test_failed_read_raises_at_wait_frees_the_slot_and_can_be_retried(make_store):
    store, fake, _ = make_store()
    put_all(store, fake, 1)
    fake.fail_reads.append(OSError(5, "Input/output error"))
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    with pytest.raises(OSError, match="Input/output"):
        store.wait("t0", Tier.DEVICE)
    assert store.state("t0", Tier.DEVICE) is Residency.ABSENT
    assert store.stats()["device"]["bytes"] == 0
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    assert torch.equal(store.wait("t0", Tier.DEVICE), tensor(0))


def test_failed_put_marks_the_tensor_lost_never_silent_zeros(make_store):
    store, fake, _ = make_store()
    fake.fail_writes.append(OSError(28, "No space left on device"))
    store.put("a", tensor(1), Tier.NVME)
    fake.complete()
    with pytest.raises(OSError, match="No space"):
        store.wait("a", Tier.NVME)
    with pytest.raises(StoreError, match="'a' is lost"):
        store.fetch("a", Tier.DEVICE)


def test_failed_write_back_keeps_the_bytes_and_reports(make_store):
    store, fake, _ = make_store()
    put_all(store, fake, 1)
    store.fetch("t0", Tier.DEVICE)
    fake.complete()
    store.wait("t0", Tier.DEVICE).fill_(9)
    store.mark_dirty("t0", Tier.DEVICE)
    fake.fail_writes.append(OSError(5, "Input/output error"))
    store.evict("t0", Tier.DEVICE)
    fake.complete()
    assert store.state("t0", Tier.DEVICE) is Residency.RESIDENT  # not dropped: only copy
    with pytest.raises(OSError, match="Input/output"):
        store.wait("t0", Tier.DEVICE)
    assert torch.equal(store.wait("t0", Tier.DEVICE), torch.full((1000,), 9.0))


def test_transitions_that_make_no_sense_are_refused(make_store):
    store, fake, _ = make_store()
    put_all(store, fake, 1)
    with pytest.raises(StoreError, match="home tier"):
        store.evict("t0", Tier.NVME)
    with pytest.raises(StoreError, match="not resident"):
        store.mark_dirty("t0", Tier.DEVICE)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        store.fetch("nope", Tier.DEVICE)
    with pytest.raises(ValueError, match="unknown tier 'ssd'"):
        store.fetch("t0", "ssd")


def test_staging_through_host_memory_counts_in_the_host_budget(fake_tier):
    # DEVICE here is a fake non-addressable tier, like CUDA: NVMe -> host staging -> device
    log: list = []
    host_pool = BufferPool(2 * KB, name="host")
    store = TensorStore({Tier.DEVICE: fake_tier(Tier.DEVICE, log=log), Tier.HOST: HostMemoryTier(Tier.HOST, host_pool),
                         Tier.NVME: fake_tier(Tier.NVME, log=log)}, staging=host_pool)
    store.put("a", tensor(3), Tier.NVME)
    store.fetch("a", Tier.DEVICE)
    assert [e[0] for e in log[-2:]] == ["read", "write"]  # nvme read into staging, then device write
    store.evict("a", Tier.DEVICE)
    assert host_pool.in_use_bytes == 0 and host_pool.peak_bytes <= 2 * KB
    assert torch.equal(store.wait("a", Tier.HOST), tensor(3))


def test_a_load_that_began_before_another_copy_changed_is_loaded_again(make_store):
    """A device copy still reading the old bytes from NVMe when the host copy is changed in
    place (an optimizer updating a parameter group) must not arrive as the newest bytes."""
    store, fake, _ = make_store()
    put_all(store, fake, 1)
    store.fetch("t0", Tier.DEVICE)  # both read NVMe
    store.fetch("t0", Tier.HOST)
    fake._pending.reverse()  # the host read lands first
    fake.complete(1)
    store.wait("t0", Tier.HOST).fill_(7)
    store.mark_dirty("t0", Tier.HOST)
    fake.complete()  # the device read of the old bytes lands: stale, loaded again (from host)
    assert torch.equal(store.wait("t0", Tier.DEVICE), torch.full((1000,), 7.0))


class _DeviceNotHost(FakeTier):  # a device tier outside host memory (as CUDA's): writes home need staging
    def tensor(self, slot):
        return torch.frombuffer(slot["data"], dtype=torch.uint8)


def _staged_store(host_slots: int, manual: bool):
    pool = BufferPool(host_slots * KB, name="host")
    nvme = FakeTier(Tier.NVME, manual=manual)
    tiers = {Tier.DEVICE: _DeviceNotHost(Tier.DEVICE), Tier.HOST: HostMemoryTier(Tier.HOST, pool), Tier.NVME: nvme}
    return TensorStore(tiers, staging=pool), nvme


def test_a_write_home_short_of_a_staging_buffer_leaves_its_copy_resident_and_dirty():
    """A write is refused before its copy becomes STORING (it was left storing with nothing
    in flight: wait_stored slept for ever); a write queued behind another never waits in the
    first one's completion (an engine thread), and fails at the next wait when nothing in
    flight can free a staging buffer."""
    n = KB // 4
    store, nvme = _staged_store(2, manual=False)
    store.put("a", torch.ones(n), Tier.NVME)
    store.wait("a", Tier.DEVICE)
    store.put("b", torch.ones(2 * n), Tier.HOST)  # (the host pool full)
    store.mark_dirty("a", Tier.DEVICE)
    with pytest.raises(BudgetError, match="waits for a host staging buffer"):
        store.evict("a", Tier.DEVICE)
    assert store.state("a", Tier.DEVICE) is Residency.RESIDENT
    store.wait_stored("a", Tier.DEVICE)
    store, nvme = _staged_store(3, manual=True)
    for key in "ac":
        store.put(key, torch.ones(n), Tier.NVME)
        nvme.complete()
    store.fetch("a", Tier.HOST)
    nvme.complete()
    store.wait("a", Tier.HOST).fill_(2)
    store.mark_dirty("a", Tier.HOST)
    store.evict("a", Tier.HOST)  # (written home)
    store.wait("a", Tier.DEVICE).fill_(3)
    store.mark_dirty("a", Tier.DEVICE)
    store.evict("a", Tier.DEVICE)  # (queued behind the host copy's write)
    store.put("b", torch.ones(2 * n), Tier.HOST)
    store.fetch("c", Tier.HOST)  # (queued for host room)
    nvme.complete(1)  # (the first write lands: the next finds no staging buffer, and waits)
    assert store.state("a", Tier.DEVICE) is Residency.STORING
    nvme.complete()
    with pytest.raises(BudgetError, match="waits for a host staging buffer"):
        store.wait_stored("a", Tier.DEVICE)
    assert store.state("a", Tier.DEVICE) is Residency.RESIDENT
