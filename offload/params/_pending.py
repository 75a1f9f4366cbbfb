"""New bytes an optimizer owes some parameter groups: a step whose update runs during the
next forward (``offload.optim``'s ``NextForward``) registers here, and every way to read a
group's bytes asks first.

The coordinator asks before it materializes a group (and never reads ahead a group still
owed), a torch call on a managed parameter asks for the parameter's group (resident groups
included: their parameters are updated where they are), and whole-model readers (checkpoints,
export, ``unwrap``) settle everything. Groups are named by their whole group (a rank's slice
by the group it is a slice of).
"""

from __future__ import annotations

from typing import Protocol

from ._groups import ParamGroup

__all__ = ["PendingWrites", "Writer"]


class Writer(Protocol):
    def stale(self, group: ParamGroup) -> bool:
        """Whether ``group``'s stored bytes are older than the ones this writer owes it."""

    def before_use(self, group: ParamGroup) -> None:
        """Write ``group``'s new bytes now (and whatever must come before them)."""

    def settle(self) -> None:
        """Write everything owed; the writer removes itself."""

    def abandon(self) -> None:
        """Give up what is owed (the model is closing and it could not be written); the
        writer removes itself and says what was lost where it matters."""


class PendingWrites:
    """The writers that owe one wrapped model's groups new bytes (usually none or one)."""

    def __init__(self) -> None:
        self.writers: list[Writer] = []

    def __bool__(self) -> bool:
        return bool(self.writers)

    def add(self, writer: Writer) -> None:
        self.writers.append(writer)

    def remove(self, writer: Writer) -> None:
        if writer in self.writers:
            self.writers.remove(writer)

    def stale(self, group: ParamGroup) -> bool:
        whole = group.whole or group
        return any(w.stale(whole) for w in self.writers)

    def ready(self, group: ParamGroup) -> None:
        """Before ``group``'s bytes are read: have every writer that owes it write them."""
        whole = group.whole or group
        for writer in list(self.writers):
            if writer.stale(whole):
                writer.before_use(whole)

    def settle(self) -> None:
        for writer in list(self.writers):
            writer.settle()

    def abandon(self) -> None:
        for writer in list(self.writers):
            writer.abandon()
        self.writers.clear()
