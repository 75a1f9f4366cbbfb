"""Disk faults under a running training loop: EIO, a full disk, short and zero-byte
writes, a swap file truncated or deleted underneath, a real file system that fills up.

Each run is a wrapped GPT-2 with parameters and optimizer states on NVMe, compared with the
same run in memory; faults are injected into the file engine's system calls (FaultyBackend,
tests/conftest.py) or made for real (a loop-device file system).
"""

from __future__ import annotations

import errno
import glob
import logging
import os

import pytest
import torch

import offload
from offload import MemoryPlanError
from offload.io import DiskFullError, OffloadIOError
from offload.store import StoreError

pytestmark = pytest.mark.timeout(180)


class Arm:
    """Faults that start when armed: the run saves its checkpoint cleanly, then the disk
    misbehaves on the next ``count`` calls of ``op``."""

    def __init__(self, backend, op, action, count=1):
        self.backend, self.op, self.action, self.count = backend, op, action, count

    def __call__(self):
        self.backend.faults[self.op] = [self.action] * self.count


def test_eio_on_read_names_the_file_and_the_checkpoint_survives(tmp_path, faulty, inject, save_after, step, batches,
                                                                close_all, assert_released, resume_matches, no_leaks):
    backend = inject(faulty())
    model, opt, path = save_after(tmp_path)
    Arm(backend, "preadv", errno.EIO, count=1000)()  # the disk is gone for good
    with pytest.raises(OffloadIOError, match=r"read of \d+ bytes at offset \d+ in .*offload-swap-\d+\.bin.*EIO"):
        step(model, opt, batches(3)[2])
    backend.faults.clear()
    close_all(model, opt)
    assert_released(tmp_path / "nvme")
    resume_matches(tmp_path, path, done=2, total=4)


def test_one_failed_read_can_be_retried_and_the_run_goes_on(tmp_path, faulty, inject, step, reference, offload_run,
                                                            batches, close_all, assert_released, no_leaks):
    """A transient EIO fails that step only; the next step runs on the stored values."""
    backend = inject(faulty())
    losses, _ = reference(3)
    model, opt = offload_run(tmp_path)
    try:
        ids = batches(3)
        assert step(model, opt, ids[0]) == pytest.approx(losses[0], rel=1e-5)
        backend.faults["preadv"] = [errno.EIO] * 1000  # an outage ...
        with pytest.raises(OffloadIOError, match="EIO"):
            model(input_ids=ids[1], labels=ids[1])
        backend.faults.clear()  # ... that ends
        opt.zero_grad()
        assert step(model, opt, ids[1]) == pytest.approx(losses[1], rel=1e-5)
        assert step(model, opt, ids[2]) == pytest.approx(losses[2], rel=1e-5)
    finally:
        close_all(model, opt)
    assert_released(tmp_path / "nvme")


def test_disk_full_while_writing_back_states(tmp_path, faulty, inject, save_after, step, batches, close_all,
                                             assert_released, resume_matches, no_leaks):
    backend = inject(faulty())
    model, opt, path = save_after(tmp_path)
    Arm(backend, "pwritev", errno.ENOSPC, count=1000)()
    # the step's write-backs (states, parameter groups) fail in the background: the bytes
    # stay in host memory, and synchronize() reports the failure
    step(model, opt, batches(3)[2])
    with pytest.raises(DiskFullError, match=r"offload-swap-\d+\.bin.*ENOSPC.*point nvme_path at a larger disk"):
        opt.synchronize()
    backend.faults.clear()
    # the next step meets the other failed writes and says so (or refuses to go on from a
    # partial step) rather than computing with bytes that never reached the disk
    with pytest.raises((StoreError, OffloadIOError, RuntimeError), match="ENOSPC|lost|stopped after updating"):
        step(model, opt, batches(4)[3])
        opt.synchronize()  # (the step's update runs in the next forward, or here)
    close_all(model, opt)
    assert_released(tmp_path / "nvme")
    resume_matches(tmp_path, path, done=2, total=4)


def test_short_writes_and_reads_are_completed(tmp_path, faulty, inject, reference, offload_run, step, batches,
                                              close_all, assert_released, no_leaks):
    """The kernel may move fewer bytes than asked; the engine finishes the transfer."""
    backend = inject(faulty({"pwritev": ["short"] * 40, "preadv": ["short"] * 40}))
    losses, _ = reference(3)
    model, opt = offload_run(tmp_path)
    try:
        got = [step(model, opt, ids) for ids in batches(3)]
    finally:
        close_all(model, opt)
    torch.testing.assert_close(got, losses)
    assert not backend.faults["pwritev"] and not backend.faults["preadv"]  # the faults did fire
    assert_released(tmp_path / "nvme")


def test_a_write_that_moves_nothing_is_a_full_disk(tmp_path, faulty, inject, save_after, step, batches, close_all,
                                                   assert_released, resume_matches, no_leaks):
    backend = inject(faulty())
    model, opt, path = save_after(tmp_path)
    Arm(backend, "pwritev", "zero", count=1000)()
    with pytest.raises(DiskFullError, match=r"offload-swap-\d+\.bin"):
        step(model, opt, batches(3)[2])
        opt.synchronize()  # the write-backs run in the background
    backend.faults.clear()
    close_all(model, opt)
    assert_released(tmp_path / "nvme")
    resume_matches(tmp_path, path, done=2, total=3)


@pytest.mark.parametrize("io_backend", ["direct", "mmap"])
def test_swap_file_truncated_underneath_a_running_model(tmp_path, io_backend, save_after, step, batches, close_all,
                                                        assert_released, resume_matches, no_leaks):
    """With mmap, touching a mapped page past the end of the file would be SIGBUS: the
    size is checked first."""
    model, opt, path = save_after(tmp_path, io_backend=io_backend)
    for swap in glob.glob(str(tmp_path / "nvme" / "offload-swap-*.bin")):
        os.truncate(swap, 0)
    with pytest.raises(OffloadIOError, match=r"offload-swap-\d+\.bin.*truncated"):
        step(model, opt, batches(3)[2])
    close_all(model, opt)
    assert_released(tmp_path / "nvme")
    resume_matches(tmp_path, path, done=2, total=3)


@pytest.mark.parametrize("io_backend", ["direct", "mmap"])
def test_swap_files_deleted_underneath_keep_working_and_warn(tmp_path, io_backend, caplog, reference, offload_run,
                                                             batches, step, close_all, assert_released, no_leaks):
    """Deleting an open file (a /tmp cleaner, an rm -rf of the wrong directory) frees
    nothing while it is open: the run keeps its data, warns once naming the files, and
    ends with nothing on disk."""
    losses, weights = reference(4)
    model, opt = offload_run(tmp_path, io_backend=io_backend)
    try:
        ids = batches(4)
        got = [step(model, opt, ids[0])]
        for swap in glob.glob(str(tmp_path / "nvme" / "offload-swap-*.bin")):
            os.unlink(swap)
        with caplog.at_level(logging.WARNING, logger="offload"):
            got += [step(model, opt, x) for x in ids[1:]]
        torch.testing.assert_close(got, losses)
        warnings = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
        assert len(warnings) == 1 and "offload-swap-0.bin" in warnings[0], warnings
    finally:
        close_all(model, opt)
    assert_released(tmp_path / "nvme")


@pytest.mark.root
def test_a_real_file_system_filling_up_mid_run(tmp_path, loop_fs, tiny_gpt2, offload_config, reference, batches,
                                               assert_released, no_leaks):
    """A 64 MiB ext4 file system: wrap fits, then another program fills the disk; the
    optimizer's states no longer fit and are refused before any is written, naming the
    directory, the bytes and the fix."""
    mount = loop_fs(size="64M")
    nvme = os.path.join(mount, "nvme")
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, nvme_path=nvme, file_size="4MiB"))
    filler = os.path.join(mount, "filler")
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:  # another program takes what is left
        os.posix_fallocate(fd, 0, max(os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize - (512 << 10), 4096))
    finally:
        os.close(fd)
    try:
        with pytest.raises(MemoryPlanError, match=rf"optimizer states on NVMe need .* but '{nvme}' has .* free: "
                                                  r"free space there.*optimizer_tier='host'"):
            offload.AdamW(model.parameters(), lr=1e-3)
        with open(os.path.join(nvme, "offload.lock")) as fh:
            assert str(os.getpid()) in fh.read()  # the run holds its directory still
        losses, _ = reference(1)
        with torch.no_grad():  # wrap's files are intact: the model still runs
            loss = model(input_ids=batches(1)[0], labels=batches(1)[0]).loss
        torch.testing.assert_close(float(loss), losses[0])
    finally:
        os.unlink(filler)
        offload.close(model)
    assert_released(nvme)
