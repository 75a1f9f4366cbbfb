"""offload-profile's command line: what it refuses before measuring, what an interrupt
leaves (nothing), stale test files of dead runs, and the table's rows."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from offload.profile._disk import remove_stale_test_files
from offload.profile.cli import format_table

from test_profile import cli, fake_report, leftover_files  # (tests/profile is on the path: no package)


def start_profiler(*args: str) -> subprocess.Popen:
    # (-X faulthandler: a SIGABRT makes it print every thread's stack, which wait_until asks
    # for when the profiler is slow to get where a test wants it)
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "offload.profile", "--no-progress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(proc: subprocess.Popen, reached, failure: str, seconds: float = 150.0) -> None:
    """Wait for ``reached()``; fail saying why not: the profiler ended early, or it was still
    on its way after ``seconds`` (a loaded machine: once over a minute), with where it was
    (within pytest's 300 s for the test, the stack dump and the signal that follows included)."""
    deadline = time.monotonic() + seconds
    while not reached() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    if reached():
        return
    ended = proc.poll() is not None
    if not ended:
        proc.send_signal(signal.SIGABRT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    pytest.fail(f"{failure} ({'it exited ' + str(proc.returncode) if ended else f'not within {seconds:.0f} s'}):"
                f"\n{err[-12000:]}")


def test_refuses_a_missing_path(tmp_path):
    out = cli("--path", str(tmp_path / "nope"), "--size", "64MiB")
    assert out.returncode == 2 and "does not exist" in out.stderr and "--path" in out.stderr


def test_refuses_a_file_as_path(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    out = cli("--path", str(f), "--size", "64MiB")
    assert out.returncode == 2 and "is a file, not a directory" in out.stderr


def test_refuses_an_unwritable_path(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/self"  # root writes anywhere a mode allows; procfs refuses new files
    else:
        target = str(tmp_path / "ro")
        os.mkdir(target, 0o500)
    out = cli("--path", target, "--size", "64MiB")
    assert out.returncode == 2 and "not writable" in out.stderr, out.stderr


@pytest.mark.parametrize("flag", ["--json", "--recommend"])
def test_refuses_an_output_path_it_could_not_write_before_the_run(tmp_path, flag):
    for target, said in ((tmp_path / "no" / "r.json", "does not exist"), (tmp_path, "is a directory")):
        out = cli("--path", str(tmp_path), "--size", "64MiB", flag, str(target))
        assert out.returncode == 2 and said in out.stderr and flag in out.stderr, out.stderr
        assert not leftover_files(tmp_path) and not (tmp_path / "offload-profile.json").exists()


@pytest.mark.parametrize("size", ["lots", "-1GiB", "12XB"])
def test_refuses_a_size_that_is_not_a_size(tmp_path, size):
    out = cli("--path", str(tmp_path), f"--size={size}")
    assert out.returncode == 2 and "is not a size" in out.stderr, out.stderr
    assert not leftover_files(tmp_path)


def test_refuses_a_size_above_the_free_space(tmp_path):
    out = cli("--path", str(tmp_path), "--size", "1000TiB")
    assert out.returncode == 2 and "free" in out.stderr and "smaller --size" in out.stderr
    assert not leftover_files(tmp_path)


def test_refuses_cuda_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = cli("--path", str(tmp_path), "--size", "64MiB", "--device", "cuda")
    assert out.returncode == 2 and "CUDA is not available" in out.stderr and "--device cpu" in out.stderr


def test_help_explains_every_flag(help_entries):
    out = subprocess.run([sys.executable, "-m", "offload.profile", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="1000"))  # one line per entry: no word broken at a hyphen
    assert out.returncode == 0
    for flag in ("--path", "--size", "--device", "--quick", "--full", "--json", "--recommend",
                 "--model-bytes", "--dtype", "--fio", "--validate", "--no-cache", "--no-progress", "--verbose"):
        assert flag in out.stdout, flag
        # argparse lists a flag whether it is explained or not: its own entry must say something
        assert len(help_entries(out.stdout).get(flag, "").split()) >= 3, (flag, help_entries(out.stdout).get(flag))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_validate_removes_its_swap_files(tmp_path, sig):
    proc = start_profiler("--no-cache", "--path", str(tmp_path), "--size", "64MiB", "--quick", "--validate", "2GiB")
    swap = tmp_path / f".offload-profile-{proc.pid}-validate.tmp"
    wait_until(proc, lambda: swap.exists() and any(swap.iterdir()), "the validation never started")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not leftover_files(tmp_path)


def test_a_dead_runs_validate_directory_is_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".offload-profile-{dead.pid}-validate.tmp"
    stale.mkdir()
    (stale / "swap-0.bin").write_bytes(b"x")
    assert remove_stale_test_files(str(tmp_path)) == [str(stale)]
    assert not stale.exists()


def test_refuses_a_validate_below_its_floor_without_touching_size(tmp_path):
    out = cli("--path", str(tmp_path), "--size", "32MiB", "--validate", "1GiB")
    assert out.returncode == 2 and "--size" in out.stderr and "at least 64MiB" in out.stderr
    out = cli("--path", str(tmp_path), "--validate", "1MiB")
    assert out.returncode == 2 and "--validate" in out.stderr and "too small" in out.stderr
    out = cli("--path", str(tmp_path), "--size", "64MiB", "--validate", "100TiB")
    assert out.returncode == 2 and "less than --validate" in out.stderr
    assert not leftover_files(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_removes_the_test_files(tmp_path, sig):
    proc = start_profiler("--path", str(tmp_path), "--size", "512MiB", "--full")
    wait_until(proc, lambda: leftover_files(tmp_path), "the profiler never created its test file")
    time.sleep(0.5)  # well inside the sweep
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; test files removed" in err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_stale_test_files_of_dead_runs_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".offload-profile-{dead.pid}-abcd.tmp"
    stale.write_bytes(b"x" * 4096)
    mine = tmp_path / f".offload-profile-{os.getpid()}-abcd.tmp"
    mine.write_bytes(b"x")
    assert remove_stale_test_files(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and mine.exists()


def test_format_table_shows_cuda_rows_and_shares(tmp_path):
    report = fake_report(tmp_path)
    report.update({
        "disk_direct_supported": True, "disk_first_write_gbps": 1.8, "disk_buffered_read_gbps": 0.6,
        "disk_buffered_write_gbps": 1.2, "host_copy_gbps": 9.0, "host_copy": {"bytes": 256 << 20, "threads": 2},
        "adam_params_per_s": 1.6e9, "adam": {"threads": 2, "params": 16 << 20},
        "h2d_pinned_gbps": 52.0, "d2h_pinned_gbps": 50.0, "h2d_pageable_gbps": 20.0, "d2h_pageable_gbps": 18.0,
        "pcie": {"gt_per_s": 32.0, "lanes": 16, "gbps": 63.0},
        "disk_h2d_overlap": {"disk_read_alone_gbps": 2.5, "h2d_alone_gbps": 52.0, "disk_read_with_h2d_gbps": 2.4,
                             "h2d_with_disk_gbps": 50.0, "overlap_efficiency": 0.96, "overlaps": True},
        "fio": {"read_gbps": 2.6, "write_gbps": 2.5, "read_share": 2.5 / 2.6, "write_share": 1.0},
        "mode": "quick", "disk_bytes_per_measurement": 1 << 30, "elapsed_s": 20.0,
    })
    table = format_table(report)
    assert "0.96 of fio 2.60" in table
    assert "passes of 2.00 GiB, spread 1.80-2.00" in table  # reads were split
    assert "passes of 2.00 GiB (whole: too short to leave out 1 s), spread 2.00-2.30" in table
    assert "disk write, first 1 s (burst)" in table and "4.90 GB/s" in table
    assert "disk read, cached (re-read of data just read)" in table and "not recommended on" in table
    assert "host to device, pinned" in table and "0.83 of PCIe 32 GT/s x16 (63.0)" in table
    assert "disk read + H2D at once" in table and "0.96 of both alone" in table


def test_a_path_held_in_ram_is_said_and_its_size_bounded(tmp_path, monkeypatch):
    """(tmpfs accepts O_DIRECT on newer kernels: it was profiled as a disk, and a default
    12 GiB test file would have taken half of this machine's RAM.)"""
    from offload.profile import _run

    monkeypatch.setattr(_run, "ram_file_system", lambda path: "tmpfs")
    memory = collections.namedtuple("memory", "total available")
    monkeypatch.setattr(_run.psutil, "virtual_memory", lambda: memory(1 << 40, 1 << 30))
    with pytest.raises(OSError, match=r"half the RAM available: tmpfs holds files in RAM.*smaller --size"):
        _run.check_target(str(tmp_path), 1 << 30, "cpu")
    _run.check_target(str(tmp_path), 256 << 20, "cpu")
