"""The NVMe tier on real files: layout, lock, cleanup, disk space, faults."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from offload.io import DiskFullError, OffloadIOError
from offload.store import DirectoryLockedError, Tier, create_store

MiB = 1 << 20


def swap_files(path):
    return sorted(f for f in os.listdir(path) if f.startswith("offload-swap"))


BACKENDS = pytest.mark.parametrize("io_backend", ["direct", "mmap"])


def small_store(path, **kw):
    args = dict(device="cpu", device_budget="32MiB", host_budget="32MiB", nvme_path=str(path),
                file_size="4MiB", block_size="256KiB")
    args.update(kw)
    return create_store(**args)


@BACKENDS
def test_a_few_large_files_with_freed_space_reused(io_backend, disk_dir, no_leaks):
    with small_store(io_backend=io_backend, path=disk_dir) as store:
        for i in range(30):
            store.put(f"t{i}", torch.randn(25_000), Tier.NVME)  # 100 KB each
        for i in range(30):
            store.wait(f"t{i}", Tier.NVME)
        assert swap_files(disk_dir) == ["offload-swap-0.bin"]
        claimed = store.tiers[Tier.NVME].files.file_bytes
        for i in range(0, 30, 2):
            store.delete(f"t{i}")
        for i in range(15):
            store.put(f"again{i}", torch.randn(25_000), Tier.NVME)
        assert store.tiers[Tier.NVME].files.file_bytes == claimed
        store.put("huge", torch.zeros(2 * MiB), Tier.NVME)  # 8 MiB: a file of its own size
        store.wait("huge", Tier.NVME)
        assert len(swap_files(disk_dir)) == 2
        mode = os.stat(os.path.join(disk_dir, "offload-swap-0.bin")).st_mode & 0o777
        assert mode == 0o600
        assert torch.equal(store.wait("huge", Tier.DEVICE), torch.zeros(2 * MiB))


@BACKENDS
def test_close_removes_files_and_lock(io_backend, disk_dir, no_leaks):
    store = small_store(io_backend=io_backend, path=disk_dir)
    store.put("a", torch.ones(10), Tier.NVME)
    store.close()
    assert os.listdir(disk_dir) == []
    store.close()  # idempotent


def test_exit_without_close_removes_files(tmp_path):
    nvme = tmp_path / "nvme"
    code = textwrap.dedent(f"""
        import torch
        from offload.store import create_store
        s = create_store(nvme_path={str(nvme)!r}, file_size="1MiB", device_budget="8MiB", host_budget="8MiB")
        s.put("a", torch.ones(1000), "nvme")
        s.wait("a", "device")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not nvme.exists() or os.listdir(nvme) == []


@BACKENDS
def test_second_user_of_a_directory_is_refused_naming_the_holder(io_backend, disk_dir, no_leaks):
    with small_store(io_backend=io_backend, path=disk_dir):
        # (in this process: a second model given the same path, which a rank's advice did not fit)
        with pytest.raises(DirectoryLockedError, match=r"in use by another wrapped model or store of this "
                                                       r"process.*its own nvme_path.*dropped without that"):
            small_store(io_backend=io_backend, path=disk_dir)
        code = f"from offload.store import create_store; create_store(nvme_path={disk_dir!r})"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert f"in use by process {os.getpid()}" in out.stderr
    with small_store(io_backend=io_backend, path=disk_dir):  # free again once closed
        pass


@BACKENDS
def test_stale_files_of_a_killed_process_are_removed(io_backend, disk_dir, no_leaks):
    with open(os.path.join(disk_dir, "offload-swap-0.bin"), "wb") as fh:
        fh.write(b"x" * 4096)
    with small_store(io_backend=io_backend, path=disk_dir) as store:
        assert swap_files(disk_dir) == []
        store.put("a", torch.ones(4), Tier.NVME)
        assert torch.equal(store.wait("a", Tier.HOST), torch.ones(4))


@pytest.mark.parametrize("problem", ["file", "no_parent"])
@BACKENDS
def test_bad_nvme_path_is_refused_with_the_fix(io_backend, tmp_path, problem, no_leaks):
    if problem == "file":
        path = tmp_path / "a_file"
        path.write_text("")
        match = "is a file, not a directory"
    else:
        path = tmp_path / "missing" / "deeper"
        match = "does not exist"
    with pytest.raises(OSError, match=match):
        small_store(io_backend=io_backend, path=path)


def test_unwritable_nvme_path_is_refused(tmp_path, as_nobody):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="not writable"):
            small_store(ro)
        return
    out = as_nobody("create_store(nvme_path=ro)")
    assert out.returncode != 0 and "not writable" in out.stderr, out.stderr[-2000:]


@pytest.mark.root
def test_nvme_path_on_a_read_only_file_system_says_so(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only file system")
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mount is not available here")
    try:
        with pytest.raises(PermissionError, match="is on a read-only file system"):
            small_store(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_disk_space_is_checked_before_it_is_claimed(disk_dir, faulty, no_leaks):
    with small_store(disk_dir, file_backend=faulty({"fallocate": [errno.ENOSPC]})) as store:
        with pytest.raises(DiskFullError, match=r"files of 4194304 bytes \(OffloadConfig file_size\).*set a smaller "
                                                r"file_size; needed 4194304 bytes, \d+ free") as info:
            store.put("a", torch.ones(10), Tier.NVME)
        assert info.value.needed == 4 * MiB
        assert swap_files(disk_dir) == []


@pytest.mark.root
@BACKENDS
def test_real_small_disk_fills_up_cleanly(io_backend, loop_fs, no_leaks):
    mount = loop_fs(sector=4096, size="32M")
    with small_store(io_backend=io_backend, path=mount, file_size="8MiB") as store:
        store.put("a", torch.ones(MiB), Tier.NVME)  # 4 MiB into the first file
        with pytest.raises(DiskFullError, match="needed") as info:
            for i in range(10):
                store.put(f"b{i}", torch.ones(2 * MiB), Tier.NVME)  # 8 MiB each: new files
        assert info.value.needed > info.value.free
        assert torch.equal(store.wait("a", Tier.DEVICE), torch.ones(MiB))  # earlier data intact


@pytest.mark.root
@BACKENDS
def test_store_on_4k_sector_disk(io_backend, loop_fs, no_leaks):
    mount = loop_fs(sector=4096)
    with small_store(io_backend=io_backend, path=mount) as store:
        assert store.tiers[Tier.NVME].files.align == 4096
        values = {f"t{i}": torch.randn(i * 333 + 1) for i in range(20)}
        for k, v in values.items():
            store.put(k, v, Tier.NVME)
        for k, v in values.items():
            assert torch.equal(store.wait(k, Tier.DEVICE), v)


@BACKENDS
def test_store_on_tmpfs(io_backend, no_leaks):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/offload-test-store-{os.getpid()}"
    with small_store(io_backend=io_backend, path=path) as store:
        t = torch.randn(123_457)
        store.put("a", t, Tier.NVME)
        assert torch.equal(store.wait("a", Tier.DEVICE), t)
    assert not os.path.exists(path) or os.listdir(path) == []


def test_buffered_fallback_store(disk_dir, faulty, no_leaks):
    backend = faulty({"open_direct": [errno.EINVAL] * 10})
    with small_store(disk_dir, file_backend=backend) as store:
        t = torch.randn(100_000)
        store.put("a", t, Tier.NVME)
        assert torch.equal(store.wait("a", Tier.DEVICE), t)
        assert not any(call[3] for call in backend.calls)


def test_nvme_read_lands_in_the_device_buffer_without_a_copy(disk_dir, faulty, no_leaks):
    backend = faulty()
    with small_store(disk_dir, file_backend=backend) as store:
        t = torch.randn(MiB)  # 4 MiB
        store.put("a", t, Tier.NVME)
        store.wait("a", Tier.NVME)
        store.reset_peaks()
        before = store.stats()
        got = store.wait("a", Tier.DEVICE)
        slot = store.info("a").copies[Tier.DEVICE].slot
        assert got.data_ptr() == slot.address  # the view is the buffer the read filled
        after = store.stats()
        assert after["host_pool"]["peak_bytes"] == before["host_pool"]["bytes"]  # no staging
        assert after["host"]["bytes"] == 0
        reads = [c for c in backend.calls if c[0] == "preadv"]
        assert all(c[3] for c in reads) and sum(c[2] for c in reads) == 4 * MiB
        assert torch.equal(got, t)


def test_io_errors_reach_wait_naming_the_swap_file(disk_dir, faulty, no_leaks):
    backend = faulty({"preadv": [errno.EIO]})
    with small_store(disk_dir, file_backend=backend) as store:
        store.put("a", torch.ones(1000), Tier.NVME)
        with pytest.raises(OffloadIOError, match=r"read of \d+ bytes at offset 0 in .*offload-swap-0.bin.*EIO"):
            store.wait("a", Tier.DEVICE, timeout=30)
        assert torch.equal(store.wait("a", Tier.DEVICE, timeout=30), torch.ones(1000))  # retry works


def test_write_error_on_put_is_reported_and_the_tensor_is_lost(disk_dir, faulty, no_leaks):
    backend = faulty({"pwritev": [errno.ENOSPC]})
    with small_store(disk_dir, file_backend=backend) as store:
        store.put("a", torch.ones(1000), Tier.NVME)
        with pytest.raises(DiskFullError, match="offload-swap-0.bin"):
            store.wait("a", Tier.NVME, timeout=30)
        with pytest.raises(DiskFullError, match="'a' is lost: write .*offload-swap-0.bin.*ENOSPC.*put it again"):
            store.wait("a", Tier.DEVICE, timeout=30)


@BACKENDS
def test_swap_file_truncated_underneath_raises_clearly(io_backend, disk_dir, no_leaks):
    with small_store(io_backend=io_backend, path=disk_dir) as store:
        store.put("a", torch.ones(MiB), Tier.NVME)
        store.wait("a", Tier.NVME)
        os.truncate(os.path.join(disk_dir, "offload-swap-0.bin"), 4096)
        with pytest.raises(OffloadIOError, match="truncated"):
            store.wait("a", Tier.DEVICE, timeout=30)


def test_a_write_into_a_truncated_swap_file_is_refused_not_grown_over_lost_data(disk_dir, no_leaks):
    """A write past the truncated end would grow the file again, with zeros where the
    tensors before it were, and their reads would then succeed: refused, naming it."""
    with small_store(path=disk_dir) as store:
        store.put("a", torch.ones(MiB // 4), Tier.NVME)
        store.put("b", torch.ones(MiB // 4), Tier.NVME)
        store.drain()
        os.truncate(os.path.join(disk_dir, "offload-swap-0.bin"), 0)
        store.put("b", torch.full((MiB // 4,), 2.0), Tier.NVME)  # (a new extent, after a's)
        with pytest.raises(OffloadIOError, match=r"offload-swap-0\.bin.*truncated it"):
            store.wait("b", Tier.NVME, timeout=30)
        assert os.path.getsize(os.path.join(disk_dir, "offload-swap-0.bin")) == 0
        with pytest.raises(OffloadIOError, match="truncated"):
            store.wait("a", Tier.DEVICE, timeout=30)


def test_close_on_a_failed_disk_releases_everything_and_says_what_is_left(disk_dir, monkeypatch, caplog, no_leaks):
    """unlink raising EIO (a shut-down file system) ended close() at the first swap file,
    its lock and descriptors left open; offload.close(model) raised."""
    import errno as _errno

    from offload.store import _nvme
    store = small_store(path=disk_dir)
    store.put("a", torch.ones(MiB // 4), Tier.NVME)
    store.drain()

    def unlink(path):
        raise OSError(_errno.EIO, "Input/output error", path)

    monkeypatch.setattr(_nvme.os, "unlink", unlink)
    with caplog.at_level(logging.WARNING, logger="offload"):
        store.close()
    monkeypatch.undo()
    assert "could not remove" in caplog.text and "offload-swap-0.bin" in caplog.text
    for name in os.listdir(disk_dir):  # (what the failed unlinks left; no_leaks checks the descriptors)
        os.unlink(os.path.join(disk_dir, name))


@BACKENDS
def test_device_budget_smaller_than_a_tensor_raises_with_numbers(io_backend, disk_dir, no_leaks):
    with small_store(io_backend=io_backend, path=disk_dir, device_budget="1MiB") as store:
        store.put("a", torch.ones(MiB), Tier.NVME)
        with pytest.raises(Exception, match=r"'a' needs 4194304 bytes in the device tier.*1048576"):
            store.fetch("a", Tier.DEVICE)


@pytest.mark.cuda
@BACKENDS
def test_cuda_round_trip_through_pinned_staging(io_backend, disk_dir, no_leaks):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with small_store(io_backend=io_backend, path=disk_dir, device="cuda") as store:
        t = torch.randn(MiB)
        store.put("a", t, Tier.NVME)
        got = store.wait("a", Tier.DEVICE)
        assert got.is_cuda and torch.equal(got.cpu(), t)
        got.mul_(2)
        store.mark_dirty("a", Tier.DEVICE)
        store.evict("a", Tier.DEVICE)
        assert torch.equal(store.wait("a", Tier.HOST), t * 2)
        assert store.tiers[Tier.HOST].pool.pin


def gated_writes():
    """A file backend whose writes wait at ``gate`` once ``gating`` is set: (backend, gate, gating)."""
    import threading

    from offload.io import FileBackend

    gate, gating = threading.Event(), threading.Event()

    class SlowWrites(FileBackend):
        def pwritev(self, fd, buffer, offset):
            if gating.is_set():
                gate.wait(30)
            return super().pwritev(fd, buffer, offset)

    return SlowWrites(), gate, gating


def write_a_changed_host_copy_home(store, gating, n):
    """'a' (n ones on NVMe) fetched to the host, changed to 2s, and evicted: its write home
    starts and waits at the gate."""
    store.put("a", torch.ones(n), Tier.NVME)
    store.wait("a", Tier.NVME)
    store.fetch("a", Tier.HOST)
    store.wait("a", Tier.HOST).fill_(2)
    store.mark_dirty("a", Tier.HOST)
    gating.set()
    store.evict("a", Tier.HOST)


def test_a_wait_for_readers_wakes_when_a_revived_copys_write_lands(disk_dir, no_leaks):
    """A dirty host copy is evicted (written home), then fetched again while the write runs
    (revived: it stays resident). The write's end changes no state; a wait_unread() on the
    copy (the optimizer about to update it in place) slept on, forever, until it notified."""
    import threading

    backend, gate, gating = gated_writes()
    with small_store(disk_dir, file_backend=backend) as store:
        write_a_changed_host_copy_home(store, gating, MiB // 4)
        store.fetch("a", Tier.HOST)  # revived while it is written
        waiter = threading.Thread(target=store.wait_unread, args=("a", Tier.HOST), daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # (the write still reads the copy)
        gate.set()
        waiter.join(10)
        assert not waiter.is_alive()
        assert torch.equal(store.wait("a", Tier.HOST), torch.full((MiB // 4,), 2.0))


def test_a_copy_changed_while_another_is_written_home_lands_last(disk_dir, no_leaks):
    """A dirty host copy is being written home when a device copy taken from it is changed
    (a weight written in place between an optimizer step and the next forward): the host
    copy's write is stale. The device copy's write starts when it lands, so it lands last; the
    stale copy is dropped then, not revived by a fetch (it stayed 'storing' with nothing in
    flight, and the home kept whichever write landed last)."""
    n = MiB // 4
    backend, gate, gating = gated_writes()
    with small_store(disk_dir, file_backend=backend) as store:
        write_a_changed_host_copy_home(store, gating, n)
        store.fetch("a", Tier.DEVICE)
        store.wait("a", Tier.DEVICE).fill_(3)
        store.mark_dirty("a", Tier.DEVICE)  # (the host copy's write is now stale)
        store.evict("a", Tier.DEVICE)  # (returns at once; its write starts when the stale one lands)
        assert store.state("a", Tier.DEVICE).value == "storing"
        gate.set()
        store.drain()
        assert store.state("a", Tier.HOST).value == "absent"
        assert store.state("a", Tier.DEVICE).value == "absent"
        store.fetch("a", Tier.HOST)
        assert torch.equal(store.wait("a", Tier.HOST), torch.full((n,), 3.0))
