"""fio as a yardstick (optional: used only when the ``fio`` binary is installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

__all__ = ["fio_available", "run_fio", "hugetlb_free_bytes", "reserved_hugepages"]

# Note: fio's buffer memory matters as much as its settings. fio allocates its buffers with
# malloc: 4 KiB pages, as THP is usually "madvise". On this project's reference VM, O_DIRECT
# into such memory read at about 1 GB/s where the same fio job into huge pages
# (iomem=shmhuge) read at 2.4 and wrote 3.6-3.9 GB/s against 2.4-2.6 (interleaved runs,
# 8 MiB x 32). offload's host buffers ask for transparent huge pages, so fio's best figure
# is the better of malloc and shmhuge, the latter where hugetlb pages are reserved.


def fio_available() -> bool:
    return shutil.which("fio") is not None


def run_fio(filename: str, size: int, rw: str, block_size: int, queue_depth: int, *,
            direct: bool = True, iomem: str = "malloc", timeout: float = 300) -> float:
    """GB/s of one fio job (libaio, one thread, ``queue_depth`` requests of ``block_size``
    in flight) reading or writing ``size`` bytes of ``filename``. fio lays out a missing
    file before a read, so run a read first to make the write an overwrite. ``iomem``:
    fio's buffer memory, ``"malloc"`` or ``"shmhuge"`` (needs ``queue_depth x block_size``
    of free hugetlb pages)."""
    if rw not in ("read", "write"):
        raise ValueError(f"rw={rw!r}: use 'read' or 'write'")
    cmd = ["fio", "--name=offload-profile", f"--filename={filename}", f"--rw={rw}",
           f"--bs={block_size}", f"--iodepth={queue_depth}", "--ioengine=libaio",
           f"--direct={int(direct)}", f"--size={size}", f"--iomem={iomem}", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")  # as offload's write figure: on the disk when the clock stops
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({' '.join(cmd)}): {out.stderr.strip()[-500:]}")
    job = json.loads(out.stdout)["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


def remove(filename: str) -> None:
    try:
        os.unlink(filename)
    except FileNotFoundError:
        pass


def hugetlb_free_bytes() -> int:
    """Free bytes of reserved hugetlb pages (what fio's ``iomem=shmhuge`` can use)."""
    free = size = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("HugePages_Free:"):
                    free = int(line.split()[1])
                elif line.startswith("Hugepagesize:"):
                    size = int(line.split()[1]) * 1024
    except OSError:
        return 0
    return free * size


class reserved_hugepages:
    """Reserve ``nbytes`` of hugetlb pages for the ``with`` block (root only; restores the
    previous count). ``ok`` says whether the reservation took."""

    _knob = "/proc/sys/vm/nr_hugepages"

    def __init__(self, nbytes: int):
        self.nbytes, self.ok, self._before = nbytes, False, None

    def __enter__(self) -> "reserved_hugepages":
        try:
            with open(self._knob) as fh:
                self._before = int(fh.read())
            with open(self._knob, "w") as fh:
                fh.write(str(self._before + -(-self.nbytes // (2 << 20))))
        except (OSError, ValueError):
            return self
        self.ok = hugetlb_free_bytes() >= self.nbytes
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            try:
                with open(self._knob, "w") as fh:
                    fh.write(str(self._before))
            except OSError:
                pass
