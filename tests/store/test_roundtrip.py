"""Bytes come back exactly: every dtype and shape, across every pair of tiers."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from offload.store import Tier, create_store

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
DTYPES += [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32")
           if hasattr(torch, name)]
SHAPES = [(), (0,), (3, 0, 2), (7,), (33, 17), (4097,), (2, 3, 1031)]
PAIRS = [(a, b) for a, b in itertools.permutations([Tier.NVME, Tier.HOST, Tier.DEVICE], 2)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random *bytes* viewed as ``dtype`` (NaN and odd bit patterns included)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    if flat_a.dtype is torch.bool:
        flat_a, flat_b = flat_a.view(torch.uint8), flat_b.view(torch.uint8)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


@pytest.fixture(scope="module", params=["direct", "mmap"])
def store(tmp_path_factory, request):
    s = create_store(device="cpu", device_budget="64MiB", host_budget="64MiB",
                     nvme_path=str(tmp_path_factory.mktemp("nvme")), file_size="8MiB", io_backend=request.param)
    yield s
    s.close()


@pytest.mark.parametrize("home,dest", PAIRS, ids=lambda t: t.value)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(store, dtype, shape, home, dest):
    key = f"{dtype}-{shape}-{home.value}-{dest.value}"
    original = _random(dtype, shape, seed=zlib.crc32(key.encode()))
    store.put(key, original, home)
    store.fetch(key, dest)
    got = store.wait(key, dest)
    if dest is Tier.NVME:
        assert got is None
    else:
        assert _same_bytes(got, original), key
    back = store.wait(key, home)
    if home is not Tier.NVME:
        assert _same_bytes(back, original)
    # and through the slowest tier both ways: drop the fast copies, read again
    for tier in (Tier.DEVICE, Tier.HOST):
        if tier is not home:
            store.evict(key, tier)
    final = store.wait(key, Tier.DEVICE if home is not Tier.DEVICE else Tier.HOST)
    assert _same_bytes(final, original)
    store.delete(key)
    assert key not in store


def test_non_contiguous_and_views(store):
    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    for i, t in enumerate([base.t(), base[::3, 5:40], base[:, 7], base.unsqueeze(0).expand(3, 64, 48)]):
        store.put(f"nc{i}", t, Tier.NVME)
        got = store.wait(f"nc{i}", Tier.DEVICE)
        assert torch.equal(got, t) and got.is_contiguous()
        store.delete(f"nc{i}")


def test_put_copies_so_the_caller_may_reuse_its_tensor(store):
    t = torch.ones(1000)
    store.put("reuse", t, Tier.NVME)
    t.fill_(7)
    assert torch.equal(store.wait("reuse", Tier.HOST), torch.ones(1000))
    store.delete("reuse")


def test_dirty_copy_is_written_home_on_evict(store):
    store.put("w", torch.zeros(5000), Tier.NVME)
    dev = store.wait("w", Tier.DEVICE)
    dev.add_(3)
    store.mark_dirty("w", Tier.DEVICE)
    store.evict("w", Tier.DEVICE)
    assert torch.equal(store.wait("w", Tier.HOST), torch.full((5000,), 3.0))
    store.delete("w")
