"""Which backward autograd is running on this thread, if any."""

from __future__ import annotations

import torch

__all__ = ["graph_task", "in_backward"]


def graph_task() -> int | None:
    """The running backward's graph task (-1 outside backward); None where torch has no such call."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    task = graph_task()
    return task is not None and task >= 0
