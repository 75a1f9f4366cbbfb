"""Small operating-system helpers shared by several layers."""

from __future__ import annotations

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
