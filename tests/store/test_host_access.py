"""read_into / borrow_host / overwrite_in_place: moving resting bytes to and from files
without a copy in any tier (what checkpoints use)."""

from __future__ import annotations

import pytest
import torch

from offload.io import HostBuffer
from offload.store import Residency, Tier, create_store


@pytest.fixture(params=["direct", "mmap"])
def store(disk_dir, request):
    s = create_store(device="cpu", device_budget="8MiB", host_budget="8MiB", nvme_path=disk_dir,
                     file_size="16MiB", io_backend=request.param)
    yield s
    s.close()


def _data(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("home", [Tier.NVME, Tier.HOST, Tier.DEVICE])
def test_read_into_copies_the_newest_bytes_without_a_tier_copy(store, home):
    data = _data(300_001, 1)
    store.put("t", data, home)
    dest = HostBuffer(data.numel())
    store.read_into("t", dest.bytes).wait()
    assert torch.equal(dest.bytes[: data.numel()], data)
    for tier in (Tier.NVME, Tier.HOST, Tier.DEVICE):
        if tier is not home:
            assert store.state("t", tier) is Residency.ABSENT
    if home is Tier.NVME:  # a changed device copy is the newest: it is read, not the stale file
        view = store.wait("t", Tier.DEVICE)
        view.fill_(9)
        store.mark_dirty("t", Tier.DEVICE)
        store.read_into("t", dest.bytes).wait()
        assert bool((dest.bytes[: data.numel()] == 9).all())
    with pytest.raises(ValueError, match="destination holds"):
        store.read_into("t", torch.empty(10, dtype=torch.uint8))


def test_borrow_holds_a_host_copy_until_released(store):
    data = _data(100_000, 2)
    store.put("t", data, Tier.NVME)
    assert store.borrow_host("t") is None  # only on NVMe: nothing to borrow
    store.wait("t", Tier.DEVICE)  # the CPU device tier is host memory
    view, release = store.borrow_host("t")
    assert torch.equal(view, data)
    store.evict("t", Tier.DEVICE)  # deferred while borrowed
    assert store.state("t", Tier.DEVICE) is Residency.RESIDENT
    release()
    assert store.state("t", Tier.DEVICE) is Residency.ABSENT


def test_overwrite_in_place_drops_other_copies(store):
    store.put("t", _data(50_000, 3), Tier.HOST)
    store.wait("t", Tier.DEVICE)
    view, done = store.overwrite_in_place("t")
    assert store.state("t", Tier.DEVICE) is Residency.ABSENT
    new = _data(50_000, 4)
    view.copy_(new)
    done()
    assert torch.equal(store.wait("t", Tier.DEVICE), new)
    store.put("n", new, Tier.NVME)
    assert store.overwrite_in_place("n") is None  # a file is not host memory


def test_waiting_for_a_stale_home_copy_brings_it_up_to_date(store):
    """A copy changed in place (``mark_dirty``) leaves the home copy stale. A wait for the
    home copy writes the changed one home first and keeps it where it is: a parameter group
    at home in host memory, written between steps on its device copy, was updated from the
    stale home copy (the write lost)."""
    store.put("t", _data(70_000, 4), Tier.HOST)
    view = store.wait("t", Tier.DEVICE)
    view.fill_(7)
    store.mark_dirty("t", Tier.DEVICE)
    assert bool((store.wait("t", Tier.HOST) == 7).all())
    assert store.state("t", Tier.DEVICE) is Residency.RESIDENT  # (kept: a pass may still use it)
    assert bool((store.read_copy("t") == 7).all())
    view.fill_(8)  # changed again: the next wait writes it again
    store.mark_dirty("t", Tier.DEVICE)
    store.evict("t", Tier.DEVICE)
    store.drain()
    assert bool((store.read_copy("t") == 8).all())
