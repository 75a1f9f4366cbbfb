"""What the coordinator knows of each parameter group: its state, as an enum changed through
one checked transition, its counts of acquisitions, and the typed bundles that travel
between the coordinator and its materializer.

A group's state says where its bytes stand for compute:

    RELEASED      the coordinator holds nothing of it on the device; its parameters are
                  placeholders (a prefetch, a use or nothing may come next)
    AHEAD         read ahead of a coming use (a device copy loading or loaded, a read-ahead
                  advised to the kernel, or a rank's slice fetched for a gather); not viewed
    CACHED        kept on the device across passes (the resident cache); not viewed
    MATERIALIZED  its parameters view its device buffer; held by ``refs`` acquisitions
    PARKED        still viewed with no acquisition left: a forward released it while a
                  backward runs (activation checkpointing recomputes inside backward, and
                  what that saved may be views of the buffer), kept until that backward ends

    RELEASED -> AHEAD, MATERIALIZED          AHEAD -> RELEASED
    CACHED -> MATERIALIZED, RELEASED         MATERIALIZED -> PARKED, RELEASED, CACHED
    PARKED -> MATERIALIZED, RELEASED, CACHED

Two moves go through RELEASED on purpose. A group read ahead is taken out of the
read-ahead set when its use begins, before it is materialized: while its bytes are waited
for, a search for room (which drops the farthest read-aheads) must not drop it, and with
several ranks it is not yet counted as held. A group released whose next use is near is
released first and then read ahead again (its device copy kept): whether its use is near
is asked of the window of groups not on the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["GroupState", "check_transition", "GroupRecord", "Materialized", "PendingGather", "Counts"]


class GroupState(enum.Enum):
    # Note: each member carries its answers (viewed, on_device, the states it may become) as
    # plain attributes: the coordinator asks them on every acquisition, and set or dict
    # lookups of an Enum member call its Python-level __hash__.
    def __new__(cls, label: str, viewed: bool, on_device: bool) -> "GroupState":
        member = object.__new__(cls)
        member._value_ = label
        member.viewed = viewed  # its parameters point at its buffer
        member.on_device = on_device  # its bytes are on the device for the coordinator: nothing to read ahead
        member.allowed = ()  # the states it may become (set below)
        return member

    RELEASED = ("released", False, False)
    AHEAD = ("ahead", False, False)
    CACHED = ("cached", False, True)
    MATERIALIZED = ("materialized", True, True)
    PARKED = ("parked", True, True)


_ALLOWED: dict[GroupState, tuple[GroupState, ...]] = {
    GroupState.RELEASED: (GroupState.AHEAD, GroupState.MATERIALIZED),
    GroupState.AHEAD: (GroupState.RELEASED,),
    GroupState.CACHED: (GroupState.MATERIALIZED, GroupState.RELEASED),
    GroupState.MATERIALIZED: (GroupState.PARKED, GroupState.RELEASED, GroupState.CACHED),
    GroupState.PARKED: (GroupState.MATERIALIZED, GroupState.RELEASED, GroupState.CACHED),
}
for _state, _targets in _ALLOWED.items():
    _state.allowed = _targets


def check_transition(key: str, old: GroupState, new: GroupState) -> None:
    """Raise on a change of state the coordinator never makes."""
    if new not in old.allowed:
        raise RuntimeError(f"parameter group {key!r}: {old.value} -> {new.value} is not a transition of the "
                           "coordinator's group states; this is a bug in offload, please report it with "
                           "the traceback")


@dataclass(eq=False)
class GroupRecord:
    """The coordinator's record of one group."""

    state: GroupState = GroupState.RELEASED
    refs: int = 0  # acquisitions not yet released
    backward_refs: int = 0  # of refs, those taken for backward
    flat: torch.Tensor | None = None  # the uint8 buffer its parameters view, while viewed
    lease: Any = None  # what the materializer gives back at release (a mapped view's release, a gathered slot)
    started: list = field(default_factory=list)  # with a tracer: (phase, time) per acquisition
    versions: tuple = ()  # its parameters' version counters when materialized (in-place writes bump them)
    maybe_written: bool = False  # a parameter's .data was handed out while materialized
    written: int = 0  # bumped by every write to the group's bytes (in place, optimizer, load)


class Materialized(NamedTuple):
    """What a materializer hands the coordinator: the group's whole flat buffer on the
    device, and what to give back when it is released (None: nothing)."""

    flat: torch.Tensor
    lease: Any


class PendingGather(NamedTuple):
    """An all-gather issued ahead of use (several ranks): the collective's handle, the
    device-tier slot it fills (None when placed beside the tier) and the whole buffer."""

    work: Any
    slot: Any
    whole: torch.Tensor


@dataclass
class Counts:
    """What ``offload.stats`` reports of the schedule and the materializer."""

    stall_seconds: float = 0.0  # waiting for a group's bytes at its use
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    demand_fetches: int = 0  # groups fetched for a use outside their module (offload.params._demand)
    gather_seconds: float = 0.0  # waiting for all-gathers (issued at use, or ahead and not done)
    gathered_ahead: int = 0  # all-gathers issued ahead of use
    gather_over_budget_bytes: int = 0  # largest gathered group that the tier had no room for
