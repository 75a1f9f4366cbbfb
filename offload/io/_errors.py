"""Exceptions raised by the file engine. Every one names the file, the byte range and the cause."""

from __future__ import annotations

import copy
import errno as _errno
import os

__all__ = ["OffloadIOError", "DiskFullError", "EngineClosedError", "BudgetError"]


class OffloadIOError(OSError):
    """A read or write that did not complete.

    Carries ``path``, ``offset``, ``length``, ``op`` ("read" or "write") and ``errno``
    (``None`` for a short transfer that the OS did not explain, e.g. a truncated file).
    """

    def __init__(self, op: str, path: str, offset: int, length: int, err: int | None, detail: str = ""):
        self.op, self.path, self.offset, self.length = op, path, offset, length
        cause = os.strerror(err) if err is not None else "short transfer"
        code = f"{_errno.errorcode.get(err, err)}: " if err is not None else ""
        message = f"{op} of {length} bytes at offset {offset} in {path!r} failed: {code}{cause}"
        if detail:
            message += f" ({detail})"
        super().__init__(err if err is not None else 0, message)
        self.errno = err

    def __str__(self) -> str:
        return self.args[1]

    def with_context(self, context: str, fix: str = "") -> "OffloadIOError":
        """The same error (same class and fields) with ``context`` before its message and
        ``fix`` after it; raise it ``from`` the original."""
        new = copy.copy(self)
        new.__dict__.update(self.__dict__)
        new.args = (self.args[0], f"{context}: {self.args[1]}" + (f". {fix}" if fix else ""))
        return new

    def __reduce__(self):
        return (type(self), (self.op, self.path, self.offset, self.length, self.errno))


class DiskFullError(OffloadIOError):
    """ENOSPC, or not enough free space to claim before writing.

    ``needed`` and ``free`` (bytes) are set when known.
    """

    def __init__(self, op: str, path: str, offset: int, length: int, err: int | None = _errno.ENOSPC,
                 detail: str = "", *, needed: int | None = None, free: int | None = None):
        self.needed, self.free = needed, free
        if needed is not None and free is not None:
            detail = (detail + "; " if detail else "") + (
                f"needed {needed} bytes, {free} free on the file system: free space or "
                "point nvme_path at a larger disk"
            )
        else:
            detail = (detail + "; " if detail else "") + (
                "the file system is full: free space there or point nvme_path at a larger disk")
        super().__init__(op, path, offset, length, err, detail)


class EngineClosedError(RuntimeError):
    """A request was made to, or was still pending in, a closed engine."""


class BudgetError(RuntimeError):
    """A request larger than a budget, or one that would wait for space forever.

    The message gives the request, the budget and what holds it, and the setting to change.
    """
