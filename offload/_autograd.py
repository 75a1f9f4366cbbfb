"""Which backward autograd is running on this thread, if any; work at its end."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["graph_task", "in_backward", "queue_end_of_backward"]


def graph_task() -> int | None:
    """The running backward's graph task (-1 outside backward); None where torch has no such call."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    task = graph_task()
    return task is not None and task >= 0


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends (call it inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
