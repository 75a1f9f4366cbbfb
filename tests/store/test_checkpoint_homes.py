"""Homes in checkpoint files (TensorStore.adopt): bytes read where a file already holds
them, at offsets no block size divides, the file never written, a first write moving the
tensor to a swap extent, and a file that changes under the store refused by name."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pathlib

import pytest
import torch

from offload.store import CheckpointChangedError, CheckpointRange, Tier, create_store

BACKENDS = pytest.mark.parametrize("io_backend", ["direct", "mmap"])


def _store(path, **kw):
    args = dict(device="cpu", device_budget="32MiB", host_budget="32MiB", nvme_path=os.path.join(path, "swap"),
                file_size="4MiB", block_size="256KiB")
    args.update(kw)
    return create_store(**args)


def _file(path, nbytes, seed=0) -> tuple[str, bytes]:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    raw = data.numpy().tobytes()
    with open(path, "wb") as fh:
        fh.write(raw)
    return str(path), raw


def _digest(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


@BACKENDS
def test_ranges_read_in_place_and_moved_on_first_write(disk_dir, io_backend, no_leaks):
    """Two files; a tensor of three ranges (one of 9 MiB placed where its file offset
    agrees modulo 4 KiB, one of 24 bytes, one ending at its file's unaligned end) lands
    whole in DEVICE and HOST; the swap directory gets nothing until a changed copy is
    written home, and then the files are untouched."""
    tmp_path = pathlib.Path(disk_dir)
    a, raw_a = _file(tmp_path / "a.safetensors", (9 << 20) + 5000)
    b, raw_b = _file(tmp_path / "b.safetensors", 70_001, seed=1)
    pieces = [(a, 1000, 9 << 20, 1000), (b, 24, 24, 1000 + (9 << 20)), (b, 70_001 - 4099, 4099, 1024 + (9 << 20))]
    dest = pieces[-1][3] + pieces[-1][2]
    want = bytearray(dest)
    with _store(tmp_path, io_backend=io_backend) as store:
        ranges = []
        for path, offset, length, at in pieces:
            raw = raw_a if path == a else raw_b
            ranges.append(CheckpointRange(store.open_checkpoint(path), offset, length, at))
            want[at: at + length] = raw[offset: offset + length]
        store.adopt("t", torch.uint8, (dest,), ranges)
        assert store.in_place("t") and all(r.file.direct for r in ranges)  # (O_DIRECT where the placement allows)
        expected = torch.frombuffer(want, dtype=torch.uint8)
        for tier in (Tier.DEVICE, Tier.HOST):
            got = store.wait("t", tier)
            for _, _, length, at in pieces:  # (the gaps between ranges hold nothing in particular)
                assert torch.equal(got[at: at + length], expected[at: at + length]), tier
            store.evict("t", tier)
        assert not os.listdir(tmp_path / "swap") or all(not f.startswith("offload-swap")
                                                        for f in os.listdir(tmp_path / "swap"))
        assert store.checkpoint_stats()["in_place_bytes"] == sum(length for *_, length, _ in pieces)
        before = (_digest(a), _digest(b))
        got = store.wait("t", Tier.DEVICE)
        got.mul_(0).add_(7)
        store.mark_dirty("t", Tier.DEVICE)
        store.evict("t", Tier.DEVICE)
        store.drain()
        assert not store.in_place("t")
        assert store.checkpoint_stats()["moved_bytes"] == dest
        assert torch.equal(store.wait("t", Tier.HOST), torch.full((dest,), 7, dtype=torch.uint8))  # (from swap)
        assert (_digest(a), _digest(b)) == before
    assert _digest(a) == hashlib.sha256(raw_a).hexdigest()


def test_a_file_changed_under_the_store_is_refused_by_name(tmp_path, no_leaks):
    path, _ = _file(tmp_path / "model.safetensors", 100_000)
    with _store(tmp_path) as store:
        store.adopt("t", torch.uint8, (5000,), [CheckpointRange(store.open_checkpoint(path), 100, 5000, 0)])
        store.wait("t", Tier.DEVICE)
        store.evict("t", Tier.DEVICE)
        with open(path, "r+b") as fh:  # rewritten in place (a save to the same file)
            fh.truncate(50_000)
        with pytest.raises(CheckpointChangedError, match="model.safetensors.*changed"):
            store.wait("t", Tier.DEVICE)


def test_a_checkpoint_replaced_by_rename_keeps_the_bytes_read(tmp_path, no_leaks):
    """Writers that save to a new file and rename it over the old one leave the open file
    as it was: the store keeps reading the bytes it adopted."""
    path, raw = _file(tmp_path / "model.safetensors", 100_000)
    with _store(tmp_path) as store:
        store.adopt("t", torch.uint8, (5000,), [CheckpointRange(store.open_checkpoint(path), 100, 5000, 0)])
        _file(tmp_path / "new.safetensors", 100_000, seed=3)
        os.replace(tmp_path / "new.safetensors", path)
        got = store.wait("t", Tier.DEVICE)
        assert bytes(got.numpy()) == raw[100:5100]


def test_direct_reads_are_aligned_and_a_refusal_reads_buffered_and_says_so(tmp_path, faulty, caplog, no_leaks):
    """With a backend that refuses unaligned O_DIRECT calls as a 4 KiB-sector disk does,
    every direct read of the checkpoint is aligned, and a range placed where its file
    offset agrees modulo 4 KiB has its body read direct; one that does not agree is read
    buffered. A range with a shift lands where it agrees and is moved down; one that covers
    whole blocks is read direct throughout and only its kept bytes move. A file system
    that refuses O_DIRECT at open is read buffered, with a warning."""
    path, raw = _file(tmp_path / "model.safetensors", 70_000)
    backend = faulty(sector=4096)
    with _store(tmp_path, file_backend=backend) as store:
        file = store.open_checkpoint(path)
        store.adopt("t", torch.uint8, (60_008,), [CheckpointRange(file, 8, 60_000, 8)])
        assert bytes(store.wait("t", Tier.DEVICE).numpy()[8:]) == raw[8:60_008]
        direct = [length for op, _, length, is_direct in backend.calls if is_direct]
        assert sum(direct) == 60_008 // 4096 * 4096 - 4096  # (the body; head and tail buffered)
        backend.calls.clear()
        store.adopt("u", torch.uint8, (60_000,), [CheckpointRange(file, 8, 60_000, 0)])
        assert bytes(store.wait("u", Tier.DEVICE).numpy()) == raw[8:60_008]
        assert not any(is_direct for *_, is_direct in backend.calls)
        backend.calls.clear()
        store.adopt("v", torch.uint8, (60_008,), [CheckpointRange(file, 8, 60_000, 8, shift=8)])
        assert bytes(store.wait("v", Tier.DEVICE).numpy()[:60_000]) == raw[8:60_008]
        direct = [length for op, _, length, is_direct in backend.calls if is_direct]
        assert sum(direct) == 60_008 // 4096 * 4096 - 4096
        backend.calls.clear()
        covering = CheckpointRange(file, 0, 15 * 4096, 0, shift=8, skip=8, kept=60_000)  # (a run 8 bytes off 16)
        store.adopt("w", torch.uint8, (15 * 4096,), [covering])
        assert bytes(store.wait("w", Tier.DEVICE).numpy()[:60_000]) == raw[8:60_008]
        assert all(is_direct for *_, is_direct in backend.calls)
        with pytest.raises(ValueError, match="before the tensor"):
            CheckpointRange(file, 8, 60_000, 0, shift=8)
        with pytest.raises(ValueError, match="does not fit the tensor's 60000 bytes"):
            store.adopt("x", torch.uint8, (60_000,), [CheckpointRange(file, 8, 60_000, 8, shift=8)])
    refusing = faulty({"open_direct": [errno.EINVAL, errno.EINVAL]})
    with _store(tmp_path, file_backend=refusing) as store, caplog.at_level(logging.WARNING, logger="offload"):
        file = store.open_checkpoint(path)
        store.adopt("t", torch.uint8, (9000,), [CheckpointRange(file, 8, 9000, 0)])
        assert bytes(store.wait("t", Tier.DEVICE).numpy()) == raw[8:9008]
    assert not file.direct and "O_DIRECT is not available" in caplog.text
