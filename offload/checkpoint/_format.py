"""The checkpoint directory: its manifest, checksums, and how it is swapped in atomically.

A checkpoint is a directory::

    manifest.json      written last; lists every tensor (name, dtype, shape, file, offset,
                       length, crc32) and the non-tensor state (optimizer hyper-parameters,
                       step counts, loss scale, the caller's ``extra``)
    model.bin          raw tensor bytes, each blob at a 4 KiB aligned offset
    optimizer.bin

Nothing is pickled: tensors are raw bytes described by the manifest, everything else is
JSON, so loading a checkpoint cannot run code from it.

Atomicity. Everything is written into a sibling directory ``<path>.tmp-<pid>-<nonce>``,
files and directory are fsynced, and that directory then takes the place of ``<path>``:
with ``renameat2(RENAME_EXCHANGE)`` where the file system has it (one atomic step; the old
checkpoint ends up in the temporary name and is removed), otherwise by renaming the old
one to ``<path>.prev-<pid>-<nonce>`` and the new one into place (a crash between the two
renames leaves ``<path>`` missing and a complete ``.prev`` directory, which the next load
or save of ``<path>`` puts back).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import glob
import json
import logging
import os
import shutil
import threading
import uuid
import zlib
from typing import Any

import torch

from .._os import pid_alive
from ..io import DiskFullError, OffloadIOError

__all__ = ["CheckpointError", "FORMAT", "VERSION", "version_of", "MANIFEST", "dtype_name", "dtype_of", "crc32",
           "jsonable", "sealed",
           "tensor_of", "AtomicDirectory", "recover", "read_manifest", "check_writable", "checkpoint_exists"]

log = logging.getLogger(__name__)

FORMAT = "offload-checkpoint"
VERSION = 2  # the newest this code reads and writes; 2: coded optimizer rows (moments=, master=)
MANIFEST = "manifest.json"
ALIGN = 4096

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[getattr(torch, _attr)] = _name
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: incomplete, corrupt, or not matching."""


def version_of(optimizer_info: dict | None) -> int:
    """The format version a checkpoint needs: 2 where an offload optimizer's rows are coded
    (a reader of version 1 would take their bytes as fp32), else 1, which every reader reads."""
    info = optimizer_info or {}
    coded = info.get("format") == "offload" and (info.get("moments", "fp32"), info.get("master", "fp32")) != \
        ("fp32", "fp32")
    return 2 if coded else 1


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint") from None


def dtype_of(name: str) -> torch.dtype:
    try:
        return _NAMES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in the manifest") from None


def crc32(data: torch.Tensor) -> int:
    """CRC-32 of a contiguous host uint8 tensor (zlib releases the GIL on large buffers)."""
    if data.numel() == 0:
        return 0
    return zlib.crc32(memoryview(data.numpy()))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str) -> str:
    """The parent directory of ``path``, created if needed; raises if it cannot be written."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path.rstrip("/")) or "/"
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create the directory {parent!r} for {path!r}: {err.strerror}; "
                              "choose a path on a writable disk") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"the directory {parent!r} is not writable by this process, so {path!r} "
                              "cannot be saved there: fix its permissions or choose another path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path!r} exists and is a file, not a checkpoint directory: choose "
                              "another path")
    return parent


_libc = None


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}) failed: {os.strerror(err)}")


def _stale(entry: str) -> bool:
    """A ``.tmp-<pid>-...`` or ``.prev-<pid>-...`` sibling left by a process that is gone."""
    try:
        pid = int(entry.rsplit(".", 1)[1].split("-")[1])
    except (IndexError, ValueError):
        return False
    return pid != os.getpid() and not pid_alive(pid)


def recover(path: str) -> None:
    """Finish what a crashed save of ``path`` left: put back a complete ``.prev``
    checkpoint if ``path`` is missing, and remove temporary directories of dead processes."""
    path = os.path.abspath(path.rstrip("/"))
    if not os.path.exists(path):
        for prev in sorted(glob.glob(glob.escape(path) + ".prev-*")):
            if _stale(prev) and os.path.exists(os.path.join(prev, MANIFEST)):
                try:
                    os.rename(prev, path)
                except FileNotFoundError:  # (another process, a rank of this run, put it back first)
                    break
                log.warning("checkpoint %s: a save was interrupted while replacing it; the previous "
                            "complete checkpoint was put back", path)
                break
    for left in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".prev-*"):
        if _stale(left):
            shutil.rmtree(left, ignore_errors=True)


def checkpoint_exists(path: str | os.PathLike) -> bool:
    """Whether a checkpoint ``save_checkpoint`` finished is at ``path``: its directory holds
    a manifest, after a complete checkpoint that an interrupted save left beside it (where
    the file system cannot swap two directories at once) is put back, as ``load_checkpoint``
    puts it back. A resume flag asks this, not whether the manifest file exists."""
    path = os.path.abspath(os.fspath(path).rstrip("/"))
    recover(path)
    return os.path.isfile(os.path.join(path, MANIFEST))


_removals: list[threading.Thread] = []


def _remove_later(path: str) -> None:
    """Remove the replaced checkpoint in the background (deleting gigabytes of extents can
    take a noticeable fraction of a second); what a process exit leaves is removed by
    ``recover`` next time, and ``wait_for_removals`` joins them."""
    thread = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                              name="offload-ckpt-rm", daemon=True)
    thread.start()
    _removals.append(thread)
    _removals[:] = [t for t in _removals if t.is_alive()]


@atexit.register
def wait_for_removals() -> None:
    for thread in list(_removals):
        thread.join()


class AtomicDirectory:
    """A temporary sibling of ``path`` that :meth:`commit` puts in its place."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path.rstrip("/"))
        check_writable(self.path)
        recover(self.path)
        if os.path.isdir(self.path) and os.listdir(self.path) \
                and not os.path.exists(os.path.join(self.path, MANIFEST)):
            raise CheckpointError(f"{self.path!r} exists, is not empty and is not an offload checkpoint "
                                  "(no manifest.json): refusing to replace it; choose another path")
        nonce = uuid.uuid4().hex[:8]
        self.tmp = f"{self.path}.tmp-{os.getpid()}-{nonce}"
        self._nonce = nonce
        try:
            os.mkdir(self.tmp, 0o755)
        except OSError as err:
            raise CheckpointError(f"cannot create {self.tmp!r}: {err.strerror}; choose a writable path") from None

    def commit(self) -> None:
        fsync_dir(self.tmp)
        parent = os.path.dirname(self.path)
        if os.path.exists(self.path):
            if _exchange(self.tmp, self.path):
                fsync_dir(parent)
                _remove_later(self.tmp)
                return
            prev = f"{self.path}.prev-{os.getpid()}-{self._nonce}"
            os.rename(self.path, prev)
            os.rename(self.tmp, self.path)
            fsync_dir(parent)
            _remove_later(prev)
        else:
            os.rename(self.tmp, self.path)
            fsync_dir(parent)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_json(path: str, obj: Any) -> None:
    """Write JSON durably: to ``path.tmp``, fsync, rename. A failure (a disk that filled
    after the tensors were written) names the file, and says that nothing was replaced:
    the caller's directory is a temporary one, aborted on the way out."""
    tmp = path + ".tmp"
    data = json.dumps(obj, indent=1, allow_nan=True).encode()
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, path)
    except OSError as err:
        detail = "the checkpoint's manifest, written last: nothing was replaced, the path holds what it held"
        if err.errno == errno.ENOSPC:
            raise DiskFullError("write", tmp, 0, len(data), detail=detail) from err
        raise OffloadIOError("write", tmp, 0, len(data), err.errno, detail) from err


def sealed(manifest: dict) -> dict:
    """``manifest`` with ``manifest_crc32``: a CRC of its own content, so a flipped bit or an
    edit of a hyper-parameter or a step count is found at load as the tensors' CRCs find
    theirs."""
    as_read = json.loads(json.dumps(manifest, allow_nan=True))  # (as a load will see it: keys strings, tuples lists)
    return {**manifest, "manifest_crc32": _manifest_crc(as_read)}


def _manifest_crc(manifest: dict) -> int:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, allow_nan=True).encode())


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path``, after checking the directory is complete."""
    path = os.path.abspath(path.rstrip("/"))
    interrupted = bool(glob.glob(glob.escape(path) + ".tmp-*"))
    recover(path)
    if not os.path.isdir(path):
        live = [t for t in glob.glob(glob.escape(path) + ".tmp-*") if not _stale(t)]
        if live:
            raise CheckpointError(f"{path!r} is being saved by a process still running ({os.path.basename(live[0])}"
                                  " is its temporary directory): load it once that save has finished")
        if interrupted:
            raise CheckpointError(f"incomplete checkpoint: {path!r} was never completed (only a "
                                  "temporary directory of an interrupted save exists); load an earlier one")
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise CheckpointError(f"incomplete checkpoint: missing manifest in {path!r} (the save that wrote "
                              "it was interrupted, or this is not an offload checkpoint); load an earlier one")
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"corrupt checkpoint: cannot read {manifest_path!r}: {err}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path!r} is not an offload checkpoint manifest")
    if "manifest_crc32" in manifest and manifest["manifest_crc32"] != _manifest_crc(manifest):
        raise CheckpointError(f"corrupt checkpoint: {manifest_path!r} does not match its own checksum (a byte "
                              "of it changed after the save: an edit or a damaged disk); load an earlier one")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format version {manifest['version']}; this offload "
                              f"reads up to {VERSION}: upgrade offload")
    for name, size in manifest.get("files", {}).items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"incomplete checkpoint: {file!r} is missing")
        actual = os.path.getsize(file)
        if actual < size:
            raise CheckpointError(f"incomplete checkpoint: {file!r} has {actual} bytes, the manifest "
                                  f"needs {size}")
    return manifest


def jsonable(value: Any, what: str) -> Any:
    """``value`` as JSON (a hyper-parameter, a torch optimizer's non-tensor state): scalars
    of one-element tensors, lists of tuples; a CheckpointError names what cannot be."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckpointError(f"{what} is a tensor of shape {tuple(value.shape)}; only scalars can "
                                  "be stored as hyper-parameters")
        return value.item()
    if isinstance(value, (tuple, list)):
        return [jsonable(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, what) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{what} is a {type(value).__name__}, which a checkpoint cannot store as JSON")


def tensor_of(raw: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Raw bytes read from a checkpoint file as a tensor of ``dtype`` and ``shape``."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return raw.view(torch.bool).view(shape)
    return raw.view(dtype).view(shape)
