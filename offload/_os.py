"""Small operating-system helpers shared by several layers."""

from __future__ import annotations

import errno
import mmap
import os

__all__ = ["pid_alive", "nearest_existing_dir", "direct_io_supported", "ram_file_system"]


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


def ram_file_system(path: str) -> str | None:
    """"tmpfs" or "ramfs" when ``path`` is on a file system held in RAM, else None
    (statfs(2)'s f_type; None where statfs cannot be asked)."""
    import ctypes

    buf = ctypes.create_string_buffer(512)  # struct statfs, whose first field is f_type
    try:
        if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):  # no statfs here (not Linux)
        return None
    return {0x01021994: "tmpfs", 0x858458F6: "ramfs"}.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)
