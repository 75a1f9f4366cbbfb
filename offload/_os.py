"""Small operating-system helpers shared by several layers."""

from __future__ import annotations

import errno
import mmap
import os

__all__ = ["pid_alive", "nearest_existing_dir"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def nearest_existing_dir(path: str) -> str | None:
    """``path`` if it is a directory, else its nearest parent that is; None if none is."""
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return current


def direct_io_supported(path: str) -> bool:
    """Whether the file system of ``path`` (or of its nearest existing parent) accepts
    O_DIRECT: a small file is really created with it, then removed."""
    directory = nearest_existing_dir(path)
    if directory is None or not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".offload-direct-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as err:  # EINVAL: refused; anything else (permissions) is reported later
        return err.errno != errno.EINVAL
    try:  # some file systems accept the flag at open and refuse the transfer
        with mmap.mmap(-1, 4096) as block:  # page aligned, as O_DIRECT needs
            os.pwrite(fd, block, 0)
        return True
    except OSError as err:
        return err.errno != errno.EINVAL
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
