"""The file engine: byte-exact transfers, alignment, fallback, errors, cleanup."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading

import pytest
import torch

from offload.io import (DiskFullError, EngineClosedError, FileEngine, HostBuffer, OffloadIOError,
                        aread, awrite, logical_block_size)


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture
def engine(no_leaks):
    eng = FileEngine(block_size=64 << 10, threads=3, queue_depth=3)
    yield eng
    eng.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    "offset,length,misalign",
    [(0, 1 << 20, 0), (0, 5 << 20, 0), (4096, 12288, 0), (123, 100_001, 0), (0, 4095, 0),
     (8192, 4096 * 7 + 5, 0), (4096, 65536, 64), (7, 1, 0), (0, 0, 0)],
)
def test_round_trip_is_byte_exact(engine, disk_dir, direct, offset, length, misalign):
    eng = engine if direct else FileEngine(block_size=64 << 10, threads=2, direct=False)
    try:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        assert file.direct is direct
        data = _random_bytes(length + misalign, seed=length)[misalign:]  # misaligned address
        assert eng.write(file, offset, data).wait() == length
        back = torch.zeros(length + misalign, dtype=torch.uint8)[misalign:]
        assert eng.read(file, offset, back).wait() == length
        assert torch.equal(back, data)
    finally:
        if eng is not engine:
            eng.close()


def test_aligned_request_goes_direct_in_blocks(disk_dir, faulty, no_leaks):
    backend = faulty()
    with FileEngine(block_size=1 << 20, threads=2, backend=backend) as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        buf = HostBuffer(3 << 20)
        eng.write(file, 0, buf).wait()
        writes = [c for c in backend.calls if c[0] == "pwritev"]
        assert sorted(w[1] for w in writes) == [0, 1 << 20, 2 << 20]
        assert all(w[3] and w[2] == 1 << 20 for w in writes)


def test_unaligned_head_and_tail_are_buffered_body_direct(disk_dir, faulty, no_leaks):
    backend = faulty()
    with FileEngine(block_size=1 << 20, threads=1, backend=backend) as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        buf = HostBuffer(64 << 10)
        # offset 100 and address 100 share their misalignment: head 3996 B, body, tail
        eng.write(file, 100, buf.bytes[100:100 + 20000]).wait()
        calls = sorted(backend.calls, key=lambda c: c[1])
        assert calls[0] == ("pwritev", 100, 3996, False)
        assert calls[1] == ("pwritev", 4096, 12288, True)
        assert calls[2] == ("pwritev", 16384, 20000 - 3996 - 12288, False)


def test_priority_zero_runs_before_queued_prefetches(disk_dir, faulty, no_leaks):
    backend = faulty()
    entered, gate = threading.Event(), threading.Event()
    original = backend.pwritev

    def gated(fd, buffer, offset):
        entered.set()
        gate.wait()
        return original(fd, buffer, offset)

    with FileEngine(block_size=1 << 20, threads=1, backend=backend) as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        eng.write(file, 0, HostBuffer(1 << 20)).wait()
        backend.pwritev = gated
        first = eng.write(file, 0, HostBuffer(1 << 20))
        entered.wait()  # the only worker is now busy
        later = [eng.read(file, 0, HostBuffer(1 << 20), priority=1) for _ in range(3)]
        urgent = eng.read(file, 0, HostBuffer(1 << 20), priority=0)
        order = []
        for h in later + [urgent]:
            h.add_done_callback(lambda h, tag=("urgent" if h is urgent else "later"): order.append(tag))
        gate.set()
        for h in [first, urgent, *later]:
            h.wait()
        assert order == ["urgent", "later", "later", "later"]


def test_buffered_fallback_warns_once_and_works(disk_dir, faulty, caplog, no_leaks):
    backend = faulty({"open_direct": [errno.EINVAL, errno.EINVAL]})
    with caplog.at_level(logging.WARNING, logger="offload.io._engine"):
        with FileEngine(backend=backend) as eng:
            sub = os.path.join(disk_dir, "nodirect")
            os.mkdir(sub)
            files = [eng.open(os.path.join(sub, f"f{i}.bin"), create=True) for i in range(2)]
            assert not any(f.direct for f in files)
            data = _random_bytes(1 << 20)
            eng.write(files[0], 0, data).wait()
            back = torch.empty_like(data)
            eng.read(files[0], 0, back).wait()
            assert torch.equal(back, data)
    warnings = [r for r in caplog.records if "O_DIRECT is not available" in r.message]
    assert len(warnings) == 1 and "nodirect" in warnings[0].message


def test_direct_refused_at_transfer_time_demotes_to_buffered(disk_dir, faulty, no_leaks):
    backend = faulty({"preadv": [errno.EINVAL]})
    with FileEngine(backend=backend, threads=1) as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        data = _random_bytes(1 << 16)
        buf = HostBuffer(1 << 16)
        buf.bytes.copy_(data)
        eng.write(file, 0, buf).wait()
        back = HostBuffer(1 << 16)
        eng.read(file, 0, back).wait()
        assert torch.equal(back.bytes, data) and not file.direct


def test_tmpfs_round_trip(no_leaks):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/offload-test-{os.getpid()}.bin"
    try:
        with FileEngine() as eng:
            file = eng.open(path, create=True)
            data = _random_bytes(3 << 20 | 17)
            eng.write(file, 5, data).wait()
            back = torch.empty_like(data)
            eng.read(file, 5, back).wait()
            assert torch.equal(back, data)
    finally:
        os.unlink(path)


# -- faults -------------------------------------------------------------------------------
def test_short_transfers_are_retried(disk_dir, faulty, no_leaks):
    backend = faulty({"preadv": ["short", "short"], "pwritev": ["short"]})
    with FileEngine(backend=backend, threads=1) as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        data = _random_bytes(1 << 16)
        eng.write(file, 0, data).wait()
        back = torch.empty_like(data)
        eng.read(file, 0, back).wait()
        assert torch.equal(back, data)


def test_read_past_end_of_truncated_file_raises_naming_it(disk_dir, no_leaks):
    with FileEngine(threads=1) as eng:
        path = os.path.join(disk_dir, "f.bin")
        file = eng.open(path, create=True)
        eng.write(file, 0, HostBuffer(1 << 16)).wait()
        os.truncate(path, 4096)
        with pytest.raises(OffloadIOError) as info:
            eng.read(file, 0, HostBuffer(1 << 16)).wait(timeout=30)
        err = info.value
        assert err.path == path and err.op == "read" and err.offset == 4096
        assert "truncated" in str(err) and path in str(err)


@pytest.mark.parametrize("op,code,kind", [("preadv", errno.EIO, OffloadIOError),
                                          ("pwritev", errno.EIO, OffloadIOError),
                                          ("pwritev", errno.ENOSPC, DiskFullError)])
def test_os_errors_raise_with_file_offset_length_errno(disk_dir, faulty, op, code, kind, no_leaks):
    backend = faulty({op: [None, code]})  # the second block fails
    with FileEngine(backend=backend, threads=1, block_size=1 << 16) as eng:
        path = os.path.join(disk_dir, "f.bin")
        file = eng.open(path, create=True)
        buf = HostBuffer(1 << 18)
        if op == "preadv":
            eng.write(file, 0, buf).wait()
            handle = eng.read(file, 0, buf)
        else:
            handle = eng.write(file, 0, buf)
        with pytest.raises(kind) as info:
            handle.wait(timeout=30)
        err = info.value
        assert err.errno == code and err.path == path and err.length == 1 << 16
        assert err.offset == 1 << 16
        assert path in str(err) and os.strerror(code) in str(err)


def test_zero_byte_write_is_disk_full(disk_dir, faulty, no_leaks):
    with FileEngine(backend=faulty({"pwritev": ["zero"]}), threads=1) as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        with pytest.raises(DiskFullError):
            eng.write(file, 0, HostBuffer(4096)).wait(timeout=30)


def test_close_fails_pending_requests_and_stops_threads(disk_dir, faulty, no_leaks):
    backend = faulty()
    gate = threading.Event()
    original = backend.pwritev
    backend.pwritev = lambda fd, b, o: (gate.wait(), original(fd, b, o))[1]
    eng = FileEngine(backend=backend, threads=1, block_size=1 << 16)
    file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
    handle = eng.write(file, 0, HostBuffer(1 << 20))  # 16 blocks, one can run
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    eng.close()
    opener.join()  # the timer thread itself must be gone before the leak check
    with pytest.raises(EngineClosedError):
        handle.wait(timeout=30)
    with pytest.raises(EngineClosedError):
        eng.read(file, 0, HostBuffer(4096))


def test_a_request_racing_close_fails_instead_of_hanging(disk_dir, no_leaks, monkeypatch):
    """close() runs after a request passed the engine's open check and before its blocks
    are queued (a hook puts it exactly there): the request fails with EngineClosedError;
    it must not be queued where no worker will ever run it (its wait would never end)."""
    import offload.io._engine as engine_module

    eng = FileEngine(threads=2, block_size=1 << 16)
    file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
    view_of = engine_module._memoryview_of

    def close_first(*args):
        eng.close()
        return view_of(*args)

    monkeypatch.setattr(engine_module, "_memoryview_of", close_first)
    with pytest.raises(EngineClosedError):
        eng.read(file, 0, HostBuffer(1 << 16)).wait(timeout=10)
    eng.close()


def test_bad_arguments_are_refused(disk_dir, no_leaks):
    with pytest.raises(ValueError, match="block_size"):
        FileEngine(block_size=1000)
    with pytest.raises(ValueError, match="threads"):
        FileEngine(threads=0)
    with FileEngine() as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        with pytest.raises(ValueError, match="contiguous"):
            eng.write(file, 0, torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="writable"):
            eng.read(file, 0, b"readonly")


# -- alignment on a real 4 KiB-sector disk --------------------------------------------------
@pytest.mark.root
def test_4k_sector_file_system(loop_fs, faulty, no_leaks):
    mount = loop_fs(sector=4096)
    assert logical_block_size(mount) == 4096
    backend = faulty(sector=4096)  # also refuse anything a 4 KiB disk would refuse
    with FileEngine(backend=backend, block_size=64 << 10, threads=2) as eng:
        file = eng.open(os.path.join(mount, "f.bin"), create=True)
        assert file.direct and file.align == 4096
        for offset, length in [(0, 1 << 20), (512, 8192), (4096 + 512, 100_000), (3, 5)]:
            # memory whose address shares the offset's misalignment, as the store's does
            lead = offset % 4096
            src, dst = HostBuffer(length + lead), HostBuffer(length + lead)
            src.bytes[lead:lead + length] = _random_bytes(length, seed=offset)
            eng.write(file, offset, src.bytes[lead:lead + length]).wait()
            eng.read(file, offset, dst.bytes[lead:lead + length]).wait()
            assert torch.equal(dst.bytes[lead:lead + length], src.bytes[lead:lead + length])
    assert any(c[3] for c in backend.calls), "no transfer went O_DIRECT"


@pytest.mark.root
def test_512_sector_file_system(loop_fs, no_leaks):
    mount = loop_fs(sector=512)
    with FileEngine(block_size=64 << 10) as eng:
        file = eng.open(os.path.join(mount, "f.bin"), create=True)
        data = _random_bytes(300_000)
        eng.write(file, 512, data).wait()
        back = torch.empty_like(data)
        eng.read(file, 512, back).wait()
        assert torch.equal(back, data)


# -- asyncio face --------------------------------------------------------------------------
def test_asyncio_face_moves_the_same_bytes(disk_dir, no_leaks):
    async def main(eng, file):
        data = [_random_bytes(1 << 18, seed=i) for i in range(4)]
        await asyncio.gather(*(awrite(eng, file, i << 18, d) for i, d in enumerate(data)))
        backs = [torch.empty(1 << 18, dtype=torch.uint8) for _ in data]
        await asyncio.gather(*(aread(eng, file, i << 18, b) for i, b in enumerate(backs)))
        return all(torch.equal(a, b) for a, b in zip(data, backs))

    with FileEngine() as eng:
        file = eng.open(os.path.join(disk_dir, "f.bin"), create=True)
        assert asyncio.run(main(eng, file))


def test_asyncio_face_raises_the_error(disk_dir, no_leaks):
    async def main(eng, file):
        await aread(eng, file, 0, torch.empty(4096, dtype=torch.uint8))

    with FileEngine() as eng:
        file = eng.open(os.path.join(disk_dir, "empty.bin"), create=True)
        with pytest.raises(OffloadIOError, match="truncated"):
            asyncio.run(main(eng, file))
