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

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

from ._groups import ParamGroup

__all__ = ["MixedMark", "PendingWrites", "Writer"]


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


@dataclass(frozen=True)
class MixedMark:
    """Why a model's weights may be a mix, and which of its parameters (ids) may be."""

    reason: str
    params: frozenset[int]


class PendingWrites:
    """The writers that owe one wrapped model's groups new bytes (usually none or one), and
    the optimizers whose step or load stopped half way (``mixed``): the weights are then
    partly from that step, and every read of them is refused until a load writes every
    parameter that step may have changed (``mend``), or ``close()`` of that optimizer
    accepts them; writes (a load) go through. An optimizer's own load does not mend them:
    its states are then whole again, the model's weights not."""

    def __init__(self) -> None:
        self.writers: list[Writer] = []
        self.mixed: dict[int, MixedMark] = {}  # id(optimizer) -> what stopped half way, and where
        self.writing = 0  # inside a write into a parameter (its group is read to be changed: allowed)

    def __bool__(self) -> bool:
        return bool(self.writers) or bool(self.mixed)

    def set_mixed(self, key: int, reason: str | None, params: Iterable[int] = ()) -> None:
        """Mark (``reason``) or accept as they are (None) the weights ``key``'s stopped
        step may have left mixed: ``params``, the ids of the parameters it updates."""
        if reason is None:
            self.mixed.pop(key, None)
        else:
            self.mixed[key] = MixedMark(reason, frozenset(params))

    def mend(self, written: set[int] | None = None, *, within: set[int] | None = None) -> None:
        """A load wrote parameters whole: ``written`` (ids; None: every weight of the model).
        A mark goes once every parameter of it that is in this model (``within``) was written."""
        for key, mark in list(self.mixed.items()):
            if written is None or (mark.params & (within or set())) <= written:
                del self.mixed[key]

    @contextlib.contextmanager
    def writes(self) -> Iterator[None]:
        """A write into parameters (a load mending mixed weights) reads their groups to change
        them: not refused."""
        self.writing += 1
        try:
            yield
        finally:
            self.writing -= 1

    def refuse_if_mixed(self) -> None:
        if self.mixed and not self.writing:
            raise RuntimeError(
                f"the model's weights may be a mix: the optimizer's previous {next(iter(self.mixed.values())).reason}, "
                "so they need not be the weights of any one step. Load a checkpoint "
                "(offload.load_checkpoint(path, model, optimizer)) or the model's and the optimizer's state dicts "
                "(the optimizer's alone leaves the weights as they are), or close() that optimizer to use the "
                "weights as they are")

    def add(self, writer: Writer) -> None:
        self.writers.append(writer)

    def remove(self, writer: Writer) -> None:
        if writer in self.writers:
            self.writers.remove(writer)

    def stale(self, group: ParamGroup) -> bool:
        whole = group.whole or group
        return any(w.stale(whole) for w in self.writers)

    def ready(self, group: ParamGroup, *, reading: bool = True) -> None:
        """Before ``group``'s bytes are read (``reading``; else overwritten): have every
        writer that owes it write them."""
        if reading:
            self.refuse_if_mixed()
        whole = group.whole or group
        for writer in list(self.writers):
            if writer.stale(whole):
                writer.before_use(whole)

    def settle(self, *, reading: bool = True) -> None:
        if reading:
            self.refuse_if_mixed()
        for writer in list(self.writers):
            writer.settle()

    def abandon(self) -> None:
        for writer in list(self.writers):
            writer.abandon()
        self.writers.clear()
